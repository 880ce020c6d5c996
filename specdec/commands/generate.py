"""`specdec generate`: text for prompts given as arguments or in a JSONL file; with --json, one JSON
Lines record per prompt on stdout; with --compare-plain, plain decoding on the same weights too;
with --json-schema / --json-object / --regex / --grammar / --choice, output constrained to match."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specdec.commands.args import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    config_models,
    describe_speculation,
    pull_on_first_use,
    sampling_params,
    speculative_config,
)
from specdec.config import EngineConfig, ModelConfig, SpeculativeConfig
from specdec.prompts import read_prompts_file
from specdec.sampling_params import StructuredOutput


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for prompts")
    add_model_args(g)
    add_sampling_args(g)
    add_spec_args(g)
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same prompts and print the speedup")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="JSON Lines on stdout, one per prompt")
    g.add_argument("--batch", action="store_true", help="submit all prompts at once (default: one after another)")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema (a JSON file)")
    c.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    c.add_argument("--regex", help="constrain the output to this regular expression")
    c.add_argument("--grammar", metavar="FILE", help="constrain the output to this Lark or GBNF grammar")
    c.add_argument("--choice", action="append", help="constrain the output to one of these strings (repeatable)")
    g.add_argument("prompts", nargs="*")
    g.set_defaults(func=cmd_generate)


def engine_config(a: argparse.Namespace, speculative: SpeculativeConfig | None) -> EngineConfig:
    """The engine the flags ask for; `precision: auto` is left for the engine to resolve."""
    return EngineConfig(model=ModelConfig(model=a.model, precision=a.precision, device=a.device,
                                          max_model_len=a.max_model_len, num_threads=a.threads),
                        speculative=speculative)


def cmd_generate(a: argparse.Namespace) -> int:
    from specdec.llm import LLM

    if a.prompts and a.prompts_file:
        raise ValueError("give prompts as arguments or with --prompts-file, not both")
    prompts = read_prompts_file(a.prompts_file) if a.prompts_file else a.prompts
    if not prompts:
        raise ValueError("no prompt given")
    params = dataclasses.replace(sampling_params(a), structured=structured_output(a))
    config = engine_config(a, speculative_config(a))
    pull_on_first_use(config_models(config))  # the CLI may install; the engine itself never does
    llm = LLM(config=config)
    eng = llm.engine
    print(f"model {eng.loaded.name} ({eng.precision}, {a.device}) loaded in {eng.loaded.load_seconds:.1f}s",
          file=sys.stderr)
    print(describe_speculation(eng.config.speculative), file=sys.stderr)
    inputs: list = prompts
    if a.chat:
        inputs = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                       add_special_tokens=False) for p in prompts]
    plain = None
    if a.compare_plain and eng.speculator is not None:
        # the same resolved model settings and weights, without speculation
        plain = LLM(config=dataclasses.replace(eng.config, speculative=None), loaded=eng.loaded)
        _warm_up([llm, plain], inputs[0])
    outputs = llm.generate(inputs, params, batch=a.batch)
    if plain is not None:
        _compare_with_plain(a, plain, inputs, params, outputs)
    for prompt, out in zip(prompts, outputs):
        _print_output(a, prompt, out)
    return 0


def structured_output(a: argparse.Namespace) -> StructuredOutput | None:
    """The output constraint the flags ask for (a file that cannot be read is a ValueError)."""
    if a.json_schema:
        return StructuredOutput("json_schema", _read(a.json_schema, "--json-schema"))
    if a.grammar:
        return StructuredOutput("grammar", _read(a.grammar, "--grammar"))
    if a.json_object:
        return StructuredOutput("json")
    if a.regex is not None:
        return StructuredOutput("regex", a.regex)
    return StructuredOutput("choice", a.choice) if a.choice else None


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _print_output(a: argparse.Namespace, prompt: str, out) -> None:
    """The text (or its JSON Lines record) on stdout, the stats line on stderr."""
    if a.json:
        line = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                "finish_reason": out.finish_reason, "stats": dataclasses.asdict(out.stats)}
        if out.logprobs is not None:
            line["logprobs"] = [{str(k): v for k, v in lp.items()} for lp in out.logprobs]
        print(json.dumps(line, ensure_ascii=False), flush=True)
    else:
        print(out.text, flush=True)
    print(_stats_line(out.stats) + f", finish={out.finish_reason}]", file=sys.stderr)


def _stats_line(s) -> str:
    line = (f"[{s.generated_tokens} tokens, {s.tokens_per_second:.2f} tokens/s, decode "
            f"{s.decode_tokens_per_second:.2f} tokens/s, ttft {s.ttft_seconds:.2f}s, {s.precision}")
    if s.method != "none":
        rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        line += (f", {s.method} {s.proposer}: acceptance {rate}, {s.mean_accepted_length:.2f} tokens/forward, "
                 f"drafted {s.drafted_tokens}, accepted {s.accepted_tokens}")
        if s.method == "hybrid" and s.drafted_tokens:
            line += f" ({s.free_drafted_tokens} drafted and {s.free_accepted_tokens} accepted from the suffix lookup)"
        if s.forced_drafted_tokens:
            line += f", {s.forced_accepted_tokens} of them forced by the grammar"
    return line


def _warm_up(llms: list, prompt) -> None:
    """A few throwaway tokens on each engine from the prompt's first token (a one-token prompt fills
    no prefix-cache block): the first forwards of a process page the weights in, start the thread
    pool and make the thread tuner's first tries, which belong to neither side of the comparison."""
    from specdec.sampling_params import SamplingParams
    for llm in llms:
        llm.generate([prompt[:1]], SamplingParams(max_tokens=4, ignore_eos=True))


def _compare_with_plain(a: argparse.Namespace, plain, inputs, params, outputs) -> None:
    """Run the same prompts with plain decoding on the same weights and print the speedup."""
    ref = plain.generate(inputs, params, batch=a.batch)
    for out, base in zip(outputs, ref):
        s, b = out.stats, base.stats
        same = "identical to" if out.token_ids == base.token_ids else "differs from (sampling)"
        print(f"plain decoding:       {b.generated_tokens} tokens, {b.tokens_per_second:.2f} tokens/s", file=sys.stderr)
        rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        print(f"speculative decoding: {s.generated_tokens} tokens, {s.tokens_per_second:.2f} tokens/s "
              f"({s.method} {s.proposer}, acceptance {rate}, {s.mean_accepted_length:.2f} tokens/forward)",
              file=sys.stderr)
        print(f"speedup {s.tokens_per_second / b.tokens_per_second:.2f}x; output {same} plain", file=sys.stderr)
