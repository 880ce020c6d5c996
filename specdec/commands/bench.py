"""`specdec bench [spec|decode|serve|soak|structured|replicas|affinity|precision|threads|steps|matmul]`: one parser for every benchmark mode;
each mode's runner lives in specdec/bench/ and reads the flags it needs."""
from __future__ import annotations

import argparse
from pathlib import Path

from specdec.catalog import default_draft
from specdec.commands.args import DRAFT_PRECISION_HELP, add_model_args, pull_on_first_use
from specdec.config import PRECISIONS, SPEC_POLICIES
from specdec.prompts import SETS, set_path

MODES = ("spec", "decode", "serve", "soak", "structured", "replicas", "affinity", "precision", "threads", "steps",
         "matmul")
_OUTPUTS = {"precision": "bench-precision", "threads": "bench-threads", "steps": "bench-steps", "matmul": "bench-matmul",
            "serve": "bench-serve", "soak": "bench-soak", "structured": "bench-structured",
            "replicas": "bench-replicas", "affinity": "bench-affinity"}  # default --out / --plot stems; the others write bench.json / bench.png
_ARMS = {"serve": "plain,draft", "spec": "plain,draft_fixed,draft_cost_model,ngram,suffix,hybrid",
         "structured": "plain,forced,suffix,hybrid", "replicas": "single,ray2"}
_PROMPTS = {"decode": str(set_path("code_gen")), "structured": str(set_path("structured"))}
_MAX_TOKENS = {"structured": 384}
_NO_PLOT = ("decode", "matmul")   # modes that draw nothing
_NUM_PROMPTS = {"structured": 0}   # a structured output ends where its grammar does: room to get there


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmark: plain vs speculative arms (spec, the default), plain decoding "
                                     "alone (decode), serving under Poisson arrivals (serve), a server process under "
                                     "concurrent mixed clients (soak), constrained decoding on the structured set (structured), one server "
                                     "process against engine replicas on Ray (replicas), prefix-affinity against "
                                     "random routing of multi-turn chats (affinity), precision modes "
                                     "against float32 (precision), thread counts under competition (threads), "
                                     "forward cost by row count on random weights, any device (steps), each "
                                     "matrix product's error under int8 activations on the real target (matmul)")
    b.add_argument("mode", nargs="?", choices=MODES, default="spec")
    add_model_args(b)
    b.add_argument("--draft", default=None, help="draft model for the draft arms (default: the registry's)")
    b.add_argument("--draft-precision", choices=PRECISIONS, default=None, help=DRAFT_PRECISION_HELP)
    b.add_argument("--arms", default=None, help="spec: plain,draft_fixed,draft_cost_model,ngram,suffix,hybrid"
                                                "[,ngram_fixed]; serve: plain,draft[,ngram,suffix,hybrid]")
    b.add_argument("--sets", default=",".join(SETS),
                   help="prompt sets (spec: each run in file order through one engine per arm; serve: the "
                        "request pool, shuffled unless --in-order)")
    b.add_argument("-k", type=int, default=4)
    b.add_argument("--prompts-file", default=None,
                   help="decode: the prompt set (default code_gen); structured: the JSONL set (default structured)")
    b.add_argument("--num-prompts", type=int, default=None, help="prompts per set (default 3; structured: 0, all)")
    b.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; structured 384)")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--until-eos", action="store_true",
                   help="spec, serve: a request ends at EOS as a client's would (--max-tokens is the cap); "
                        "default: every request generates --max-tokens (peers always do)")
    b.add_argument("--out", default="bench.json")
    b.add_argument("--plot", default="bench.png", help="PNG plot (spec mode); empty for none")
    _add_mode_args(b)
    b.set_defaults(func=cmd_bench)


def _add_mode_args(b: argparse.ArgumentParser) -> None:
    """Flags that only some modes read (each help says which)."""
    b.add_argument("--precisions", default=None,
                   help="precision mode: the modes compared with float32 (default int4,int4-a16,int4-a8); steps: "
                        "the precisions timed (default float32,bfloat16; int4 modes load the real models)")
    b.add_argument("--shapes", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct",
                   help="steps: the models timed (random weights of their shapes, but for int4 modes), "
                        "the draft first, the target last")
    b.add_argument("--rows", default="1,2,3,5,8,16,64,256", help="steps: new rows per forward")
    b.add_argument("--context", type=int, default=512, help="steps: tokens already in the cache; matmul: "
                                                            "tokens of the corpus chunk")
    b.add_argument("--kind", default="code", help="matmul: the `specdec kld` corpus kind the activations come from")
    b.add_argument("--first", type=int, default=16, help="matmul: the first row measured (the first rows' "
                                                         "massive activations are a case of their own)")
    b.add_argument("--rates", default="0.05,0.1,0.2", help="serve: Poisson arrival rates (requests/s)")
    b.add_argument("--num-requests", type=int, default=8, help="serve: requests per rate; replicas: in all")
    b.add_argument("--max-prompt-tokens", type=int, default=256, help="serve: prompts are cut to this")
    b.add_argument("--max-batch-size", type=int, default=8, help="serve, replicas, affinity: running requests")
    b.add_argument("--in-order", action="store_true",
                   help="serve: requests arrive in file order (a session), not shuffled")
    b.add_argument("--clients", type=int, default=8, help="soak, replicas, affinity: concurrent clients")
    b.add_argument("--replicas", type=int, default=None,
                   help="affinity: engine replicas on Ray (default 2); soak: serve with this many replicas on Ray "
                        "(default 1: one process, no Ray)")
    b.add_argument("--cpus-per-replica", type=float, default=1.0, help="replicas, affinity: Ray CPUs per replica")
    b.add_argument("--routing", choices=("affinity", "random", "least_loaded"), default="affinity",
                   help="replicas: how the Ray arms route")
    b.add_argument("--conversations", type=int, default=16, help="affinity: conversations (from the chat set)")
    b.add_argument("--turns", type=int, default=4, help="affinity: turns per conversation")
    b.add_argument("--minutes", type=float, default=10.0, help="soak: how long the clients keep sending")
    b.add_argument("--max-requests", type=int, default=0, help="soak: stop after this many requests (0: no cap)")
    b.add_argument("--warmup-minutes", type=float, default=1.0,
                   help="soak: the same mix first, not counted (memory is measured after it)")
    b.add_argument("--kill-replica-at", type=float, default=None, metavar="SECONDS",
                   help="soak with --replicas: SIGKILL one replica this many seconds into the run; the "
                        "requests in flight on it are counted apart from failures")
    b.add_argument("--check-outputs", action="store_true",
                   help="soak: a fixed pool of bodies (greedy, seeded sampled with n 1 and 2, JSON schema, tools, "
                        "cache salts; streamed and whole), each first run alone without speculation; a completed "
                        "answer that differs from its reference counts as wrong, apart from failed")
    b.add_argument("--bodies-per-kind", type=int, default=4,
                   help="soak --check-outputs: distinct bodies of each compared kind (half of them streamed)")
    b.add_argument("--policy", choices=SPEC_POLICIES, default="cost_model",
                   help="serve, soak: speculation policy (fixed: -k drafts every step)")
    b.add_argument("--seed", type=int, default=0, help="serve: arrivals and prompt choice; soak: the clients' draws "
                                                       "(and, with --check-outputs, the sampled bodies' seeds)")
    b.add_argument("--shape", default="17920x1536",
                   help="threads: the layer timed, OUTxIN (default the 1.5B's gate|up)")
    b.add_argument("--competitors", type=int, default=1, help="threads: busy processes in the contended run")
    b.add_argument("--calls", type=int, default=10, help="threads: timed calls per cell and repeat")
    b.add_argument("--peer", choices=["none", "transformers"], default="none",
                   help="decode mode: also time transformers float32 on the same prompts, in the same run")
    b.add_argument("--peers", default="",
                   help="spec: other engines run interleaved with the arms on the same prompt ids and GGUF: "
                        "transformers, transformers_assisted (float32; the test extra), llama.cpp, "
                        "llama.cpp_lookup (prompt lookup), openvino, openvino_spec (its speculative decoding "
                        "with the draft model), openvino_lookup (prompt lookup); comma list, default none. "
                        "A peer that fails to install, load or run is recorded as failed")
    b.add_argument("--install-peers", action="store_true",
                   help="spec: install a peer engine asked for and missing: build llama-cpp-python from "
                        "source into $SPECDEC_HOME/peers/llama-cpp (about 9 minutes, once); pip-install "
                        "openvino-genai into $SPECDEC_HOME/peers/openvino (binary wheels, once)")


def _with_mode_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """A copy of the flags with the mode's own default output names and arms filled in."""
    stem = _OUTPUTS.get(a.mode)
    out = f"{stem}.json" if stem and a.out == "bench.json" else a.out
    return argparse.Namespace(**{**vars(a), "out": out,
                                 # the plot beside the JSON unless named
                                 "plot": str(Path(out).with_suffix(".png")) if a.plot == "bench.png" else a.plot,
                                 "arms": a.arms or _ARMS.get(a.mode),
                                 "prompts_file": a.prompts_file or _PROMPTS.get(a.mode),
                                 "max_tokens": a.max_tokens or _MAX_TOKENS.get(a.mode, 64),
                                 "replicas": a.replicas if a.replicas is not None else (1 if a.mode == "soak" else 2),
                                 "num_prompts": a.num_prompts if a.num_prompts is not None else _NUM_PROMPTS.get(a.mode, 3)})


def _pull_models(a: argparse.Namespace) -> None:
    """The models a mode runs, pulled on first use (the CLI may install; a server it starts may not).
    steps and threads time random weights (steps pulls what its int4 modes load itself)."""
    if a.mode in ("steps", "threads"):
        return
    # soak's `specdec serve` speculates with the target's default draft unless --draft names one
    default = default_draft(a.model) if a.mode == "soak" else None
    pull_on_first_use([a.model, a.draft or default])


def cmd_bench(a: argparse.Namespace) -> int:
    a = _with_mode_defaults(a)
    from specdec.extras import require, require_plotting
    if a.mode not in _NO_PLOT:   # before any pull: a missing extra fails at once
        require_plotting(a.plot, f"specdec bench {a.mode}")
    if a.mode == "structured":
        require("jsonschema", "bench", "specdec bench structured")
    _pull_models(a)
    if a.mode == "decode":
        from specdec.bench.decode import run_decode_bench
        run_decode_bench(a)
    elif a.mode == "precision":
        from specdec.bench.precision import run_precision_bench
        run_precision_bench(a)
    elif a.mode == "threads":
        from specdec.bench.threads import run_threads_bench
        if a.competitors < 0 or a.calls < 1 or a.repeats < 1 or a.k < 0:
            raise ValueError("--competitors must be >= 0, --calls and --repeats >= 1, -k >= 0")
        run_threads_bench(a)
    elif a.mode == "steps":
        from specdec.bench.steps import run_steps_bench
        run_steps_bench(a)
    elif a.mode == "matmul":
        from specdec.bench.matmul_error import cmd_matmul
        cmd_matmul(a)
    elif a.mode == "soak":
        from specdec.bench.soak import run_soak_bench
        if (a.clients < 1 or a.minutes <= 0 or a.max_requests < 0 or a.warmup_minutes < 0 or a.replicas < 1
                or a.bodies_per_kind < 1):
            raise ValueError("--clients, --replicas and --bodies-per-kind must be >= 1, --minutes > 0, "
                             "--max-requests and --warmup-minutes >= 0")
        if a.kill_replica_at is not None and (a.replicas < 2 or a.kill_replica_at < 0):
            raise ValueError("--kill-replica-at needs --replicas 2 or more, and SECONDS >= 0")
        run_soak_bench(a)
    elif a.mode == "structured":
        from specdec.bench.structured import run_structured_bench
        run_structured_bench(a)
    elif a.mode in ("replicas", "affinity"):
        from specdec.bench.scale_out import run_affinity_bench, run_replicas_bench
        if a.clients < 1 or a.num_requests < 1 or a.replicas < 1 or a.turns < 1 or a.conversations < 1:
            raise ValueError("--clients, --num-requests, --replicas, --turns and --conversations must be >= 1")
        (run_replicas_bench if a.mode == "replicas" else run_affinity_bench)(a)
    elif a.mode == "serve":
        from specdec.bench.serve_bench import run_serve_bench
        run_serve_bench(a)
    else:
        from specdec.bench.spec_bench import run_spec_bench
        run_spec_bench(a)
    return 0
