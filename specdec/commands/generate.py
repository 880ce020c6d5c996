"""`specdec generate`: text for prompts given as arguments, on stdin (`-`) or in a JSONL file; with
--json, one JSON Lines record per prompt on stdout; with --compare-plain, plain decoding on the same
weights too (commands/compare_plain.py); with --json-schema / --json-object / --regex / --grammar /
--choice, output constrained to match. Prompts and constraints are checked before any model loads."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from specdec.commands import compare_plain
from specdec.commands.args import (
    add_engine_args,
    add_huge_pages_arg,
    add_model_args,
    add_sampling_args,
    add_spec_args,
    cache_overrides,
    check_chat_template,
    check_device,
    config_models,
    describe_speculation,
    pull_on_first_use,
    sampling_config,
    sampling_params,
    scheduler_overrides,
    speculative_config,
)
from specdec.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from specdec.prompts import read_prompts_file
from specdec.sample.structured import check_structured
from specdec.sampling_params import SamplingParams, StructuredOutput


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for prompts")
    add_model_args(g)
    add_huge_pages_arg(g)
    add_sampling_args(g)
    add_spec_args(g)
    add_engine_args(g)
    compare_plain.add_args(g)
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
    g.add_argument("prompts", nargs="*", help="prompts; - reads one from stdin")
    g.set_defaults(func=cmd_generate)


def engine_config(a: argparse.Namespace, speculative: SpeculativeConfig | None) -> EngineConfig:
    """The engine the flags ask for; `precision: auto` is left for the engine to resolve. --seed
    seeds the engine (vLLM's meaning): each prompt draws its own stream from it, reproducibly."""
    return EngineConfig(model=ModelConfig(model=a.model, precision=a.precision, device=a.device,
                                          max_model_len=a.max_model_len, num_threads=a.threads,
                                          chat_template=a.chat_template, seed=a.seed,
                                          huge_pages=a.huge_pages is not False),
                        cache=CacheConfig(**cache_overrides(a)),
                        scheduler=SchedulerConfig(**scheduler_overrides(a)), speculative=speculative,
                        sampling=sampling_config(a))


def cmd_generate(a: argparse.Namespace) -> int:
    prompts, params, config = _checked(a)
    pull_on_first_use(config_models(config))  # the CLI may install; the engine itself never does
    llm = _load(a, config)
    flag = "--chat-template" if a.chat_template else "--chat"
    inputs: list = [_chat_prompt(llm.tokenizer, p, flag) for p in prompts] if a.chat else prompts
    report: list[str] = []
    if a.compare_plain and llm.engine.speculator is not None:
        outputs, report = compare_plain.compare(a, llm, inputs, params)
    else:
        if a.compare_plain:
            report = ["--compare-plain: speculation is off, nothing to compare"]
        outputs = llm.generate(inputs, params, batch=a.batch)
    for n, (prompt, out) in enumerate(zip(prompts, outputs), 1):
        if len(prompts) > 1 and not a.json:  # stdout keeps the texts alone; stderr says whose they are
            print(f"=== prompt {n}/{len(prompts)} ===", file=sys.stderr, flush=True)
        _print_output(a, prompt, out, llm.tokenizer)
    for line in report:
        print(line, file=sys.stderr)
    return 0


def _checked(a: argparse.Namespace) -> tuple[list[str], SamplingParams, EngineConfig]:
    """The prompts, sampling params and engine config, with everything that can fail without a
    model failing now (ValueError, one line): nothing loads for a mistake in the command."""
    prompts = read_prompts(a)
    params = dataclasses.replace(sampling_params(a), seed=None, structured=structured_output(a))
    config = engine_config(a, speculative_config(a))
    check_device(a.device)
    check_chat_template(a.chat_template)
    if a.compare_repeats < 1:
        raise ValueError(f"--compare-repeats must be >= 1, got {a.compare_repeats}")
    return prompts, params, config


def _load(a: argparse.Namespace, config: EngineConfig):
    from specdec.llm import LLM
    llm = LLM(config=config)
    eng = llm.engine
    print(f"model {eng.loaded.name} ({eng.precision}, {a.device}) loaded in {eng.loaded.load_seconds:.1f}s",
          file=sys.stderr)
    print(describe_speculation(eng.config.speculative), file=sys.stderr)
    return llm


def read_prompts(a: argparse.Namespace) -> list[str]:
    """The prompts: arguments (`-`: stdin, once) or --prompts-file. Raises ValueError naming the
    flag, or the prompt that is empty."""
    if a.prompts and a.prompts_file:
        raise ValueError("give prompts as arguments or with --prompts-file, not both")
    if a.prompts_file:
        try:
            return read_prompts_file(a.prompts_file)
        except OSError as e:
            raise ValueError(f"--prompts-file: cannot read {a.prompts_file}: {e.strerror}") from None
    if not a.prompts:
        raise ValueError("no prompt given (give one as an argument, - for stdin, or --prompts-file)")
    if a.prompts.count("-") > 1:
        raise ValueError("- (stdin) may be given once")
    prompts = [_stdin() if p == "-" else p for p in a.prompts]
    for n, p in enumerate(prompts, 1):
        if not p:
            source = " (stdin)" if a.prompts[n - 1] == "-" else ""
            raise ValueError(f"prompt {n}{source} is empty")
    return prompts


def _stdin() -> str:
    """All of stdin, less the one newline `echo` or an editor ends it with."""
    text = sys.stdin.read()
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def _chat_prompt(tokenizer, prompt: str, flag: str) -> list[int]:
    """The prompt as one user turn in the chat template (a template that fails names `flag`)."""
    import jinja2
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    except jinja2.TemplateError as e:
        raise ValueError(f"{flag}: the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def structured_output(a: argparse.Namespace) -> StructuredOutput | None:
    """The output constraint the flags ask for, validated without a model: a file that cannot be
    read, a bad schema, regex or grammar is a ValueError naming the flag."""
    flag, kind, spec = _constraint(a)
    if kind is None:
        return None
    try:
        structured = StructuredOutput(kind, spec)
        check_structured(structured)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    return structured


def _constraint(a: argparse.Namespace) -> tuple[str, str | None, object]:
    """(flag, kind, spec) of the constraint flag given; kind None when none is."""
    if a.json_schema:
        return f"--json-schema {a.json_schema}", "json_schema", _read(a.json_schema, "--json-schema")
    if a.grammar:
        return f"--grammar {a.grammar}", "grammar", _read(a.grammar, "--grammar")
    if a.json_object:
        return "--json-object", "json", None
    if a.regex is not None:
        return "--regex", "regex", a.regex
    return "--choice", ("choice" if a.choice else None), a.choice


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path} is not UTF-8 text") from None


def _print_output(a: argparse.Namespace, prompt: str, out, tokenizer) -> None:
    """The text (or its JSON Lines record) on stdout; the stats line, and logprobs in text mode, on stderr."""
    logprobs = None if out.logprobs is None else logprob_entries(out, tokenizer, a.logprobs)
    if a.json:
        line = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                "finish_reason": out.finish_reason, "stats": dataclasses.asdict(out.stats)}
        if logprobs is not None:
            line["logprobs"] = logprobs
        print(json.dumps(line, ensure_ascii=False), flush=True)
    else:
        print(out.text, flush=True)
        if logprobs:
            print("logprobs: position, token, logprob, then the other likeliest tokens", file=sys.stderr)
        for n, entry in enumerate(logprobs or []):
            others = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in entry["top_logprobs"]
                               if t["token_id"] != entry["token_id"])
            print(f"  {n:>4} {entry['token']!r:<20} {entry['logprob']:9.4f}" + (f"   top: {others}" if others else ""),
                  file=sys.stderr)
    print(_stats_line(out.stats) + f", finish={out.finish_reason}]", file=sys.stderr)


def logprob_entries(out, tokenizer, n: int) -> list[dict]:
    """Per generated token, as OpenAI spells it: the token's text, id and logprob, and its n most
    likely alternatives (`top_logprobs`, best first)."""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token_id]), "token_id": token_id, "logprob": logprob}

    rows = []
    for token_id, lps in zip(out.token_ids, out.logprobs):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:n]
        rows.append({**entry(token_id, lps[token_id]), "top_logprobs": [entry(i, v) for i, v in top]})
    return rows


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
