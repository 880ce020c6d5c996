"""`specdec bench MODE`: one subcommand a benchmark mode (spec, decode, serve, soak, structured, replicas,
affinity, precision, threads, steps, matmul), each with the flags it reads; `specdec bench` alone is spec.
Each mode's runner lives in specdec/bench/."""
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


# what each mode does (its --help), in MODES order
_DESCRIPTIONS = {
    "spec": "plain vs speculative arms on the prompt sets, with other engines as peers (the default mode)",
    "decode": "plain decoding alone on one prompt set",
    "serve": "serving under Poisson arrivals",
    "soak": "a server process under concurrent mixed clients",
    "structured": "constrained decoding on the structured set",
    "replicas": "one server process against engine replicas on Ray",
    "affinity": "prefix-affinity against random routing of multi-turn chats",
    "precision": "precision modes against float32",
    "threads": "thread counts under competition",
    "steps": "forward cost by row count against this machine's bound (random weights but for int4 modes; any "
             "device)",
    "matmul": "each matrix product's error under int8 activations on the real target",
}
_DRAFTED = ("spec", "serve", "soak", "structured", "replicas", "affinity")


# every flag a mode may take: (names, add_argument keywords, the modes that take it)
_FLAGS: list[tuple[tuple[str, ...], dict, tuple[str, ...]]] = [
    (("--draft",), dict(default=None, help="draft model for the draft arms (default: the registry's)"), _DRAFTED),
    (("--draft-precision",), dict(choices=PRECISIONS, default=None, help=DRAFT_PRECISION_HELP),
     ("spec", "serve", "structured")),
    (("--arms",), dict(default=None, help="spec: plain,draft_fixed,draft_cost_model,ngram,suffix,hybrid"
                                          "[,ngram_fixed,draft_file_*,draft_q4_*,draft_subvocab_*]; "
                                          "serve: "
                                          "plain,draft[,ngram,suffix,hybrid]"),
     ("spec", "serve", "structured", "replicas", "affinity")),
    (("--sets",), dict(default=",".join(SETS), help="prompt sets (spec: each run in file order through one "
                                                     "engine per arm; serve: the request pool, shuffled "
                                                     "unless --in-order)"), ("spec", "serve", "soak", "precision")),
    (("-k",), dict(type=int, default=4), ("spec", "serve", "soak", "structured", "threads")),
    (("--prompts-file",), dict(default=None, help="the prompt set (decode: default code_gen; structured: the "
                                                  "JSONL set, default structured)"), ("decode", "structured")),
    (("--num-prompts",), dict(type=int, default=None, help="prompts per set (default 3; structured: 0, all)"),
     ("spec", "decode", "soak", "structured", "precision")),
    (("--max-tokens",), dict(type=int, default=None, help="tokens per request (default 64; structured 384)"),
     ("spec", "decode", "serve", "soak", "structured", "replicas", "affinity", "precision")),
    (("--repeats",), dict(type=int, default=3),
     ("spec", "decode", "structured", "replicas", "affinity", "threads", "steps")),
    (("--until-eos",), dict(action="store_true", help="a request ends at EOS as a client's would (--max-tokens "
                                                      "is the cap); default: every request generates "
                                                      "--max-tokens (peers always do)"), ("spec", "serve")),
    (("--out",), dict(default="bench.json"), MODES),
    (("--plot",), dict(default="bench.png", help="PNG plot beside the JSON unless named; empty for none"),
     tuple(m for m in MODES if m not in _NO_PLOT)),
    (("--precisions",), dict(default=None, help="precision: the modes compared with float32 (default "
                                                "int4,int4-a16,int4-a8); steps: the precisions timed (default "
                                                "float32,bfloat16; int4 modes load the real models, and may "
                                                "add :q4_1, :q4_64 or :q3_64 for a requantized draft and :vocab=N for a "
                                                "sub-vocabulary's output layer; llama.cpp)"),
     ("precision", "steps")),
    (("--shapes",), dict(default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct",
                         help="the models timed (random weights of their shapes, but for int4 modes), the "
                              "draft first, the target last"), ("steps",)),
    (("--rows",), dict(default="1,2,3,5,8,16,64,256", help="new rows per forward"), ("steps",)),
    (("--context",), dict(type=int, default=512, help="steps: tokens already in the cache; matmul: tokens of "
                                                      "the corpus chunk"), ("steps", "matmul")),
    (("--kind",), dict(default="code", help="the `specdec kld` corpus kind the activations come from"),
     ("matmul",)),
    (("--first",), dict(type=int, default=16, help="the first row measured (the first rows' massive "
                                                   "activations are a case of their own)"), ("matmul",)),
    (("--rates",), dict(default="0.05,0.1,0.2", help="Poisson arrival rates (requests/s)"), ("serve",)),
    (("--num-requests",), dict(type=int, default=8, help="serve: requests per rate; replicas: in all"),
     ("serve", "replicas", "affinity")),
    (("--max-prompt-tokens",), dict(type=int, default=256, help="prompts are cut to this"), ("serve",)),
    (("--max-batch-size",), dict(type=int, default=8, help="running requests"),
     ("serve", "soak", "replicas", "affinity")),
    (("--in-order",), dict(action="store_true", help="requests arrive in file order (a session), not "
                                                     "shuffled"), ("serve",)),
    (("--clients",), dict(type=int, default=8, help="concurrent clients"), ("soak", "replicas", "affinity")),
    (("--replicas",), dict(type=int, default=None, help="affinity: engine replicas on Ray (default 2); soak: "
                                                        "serve with this many replicas on Ray (default 1: one "
                                                        "process, no Ray)"), ("soak", "replicas", "affinity")),
    (("--cpus-per-replica",), dict(type=float, default=1.0, help="Ray CPUs per replica"), ("replicas", "affinity")),
    (("--routing",), dict(choices=("affinity", "random", "least_loaded"), default="affinity",
                          help="how the Ray arms route"), ("replicas", "affinity")),
    (("--conversations",), dict(type=int, default=16, help="conversations (from the chat set)"), ("affinity",)),
    (("--turns",), dict(type=int, default=4, help="turns per conversation"), ("affinity",)),
    (("--minutes",), dict(type=float, default=10.0, help="how long the clients keep sending"), ("soak",)),
    (("--max-requests",), dict(type=int, default=0, help="stop after this many requests (0: no cap)"), ("soak",)),
    (("--warmup-minutes",), dict(type=float, default=1.0, help="the same mix first, not counted (memory is "
                                                               "measured after it)"), ("soak",)),
    (("--kill-replica-at",), dict(type=float, default=None, metavar="SECONDS",
                                  help="with --replicas: SIGKILL one replica this many seconds into the run; "
                                       "the requests in flight on it are counted apart from failures"),
     ("soak",)),
    (("--check-outputs",), dict(action="store_true",
                                help="a fixed pool of bodies (greedy, seeded sampled with n 1 and 2, JSON "
                                     "schema, tools, cache salts; streamed and whole), each first run alone "
                                     "without speculation; a completed answer that differs from its reference "
                                     "counts as wrong, apart from failed"), ("soak",)),
    (("--bodies-per-kind",), dict(type=int, default=4, help="--check-outputs: distinct bodies of each compared "
                                                            "kind (half of them streamed)"), ("soak",)),
    (("--policy",), dict(choices=SPEC_POLICIES, default="cost_model",
                         help="speculation policy (fixed: -k drafts every step)"), ("serve", "soak")),
    (("--seed",), dict(type=int, default=0, help="serve: arrivals and prompt choice; soak: the clients' draws "
                                                 "(and, with --check-outputs, the sampled bodies' seeds)"),
     ("serve", "soak")),
    (("--shape",), dict(default="17920x1536", help="the layer timed, OUTxIN (default the 1.5B's gate|up)"),
     ("threads",)),
    (("--competitors",), dict(type=int, default=1, help="busy processes in the contended run"), ("threads",)),
    (("--calls",), dict(type=int, default=10, help="timed calls per cell and repeat"), ("threads",)),
    (("--peer",), dict(choices=["none", "transformers"], default="none",
                       help="also time transformers float32 on the same prompts, in the same run"), ("decode",)),
    (("--peers",), dict(default="", help="other engines run interleaved with the arms on the same prompt ids and "
                                         "GGUF: transformers, transformers_assisted (float32; the test extra), "
                                         "llama.cpp, llama.cpp_lookup (prompt lookup), openvino, openvino_spec "
                                         "(its speculative decoding with the draft model), openvino_lookup "
                                         "(prompt lookup); comma list, default none. A peer that fails to "
                                         "install, load or run is recorded as failed"), ("spec",)),
    (("--install-peers",), dict(action="store_true",
                                help="install a peer engine asked for and missing: build llama-cpp-python from "
                                     "source into $SPECDEC_HOME/peers/llama-cpp (about 9 minutes, once); "
                                     "pip-install openvino-genai into $SPECDEC_HOME/peers/openvino (binary "
                                     "wheels, once)"), ("spec",)),
]


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks, one subcommand a mode: " + ", ".join(MODES) + " (spec when none "
                                     "is named)", description="Benchmarks; each mode has its own flags "
                                                              "(specdec bench MODE --help).")
    modes = b.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode in MODES:
        m = modes.add_parser(mode, help=_DESCRIPTIONS[mode], description=_DESCRIPTIONS[mode])
        add_model_args(m)
        for names, kwargs, takers in _FLAGS:
            if mode in takers:
                m.add_argument(*names, **kwargs)
        m.set_defaults(func=cmd_bench)


def with_default_mode(argv: list[str]) -> list[str]:
    """`specdec bench --sets ...` is `specdec bench spec --sets ...`: a mode goes in where none is named."""
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in (*MODES, "-h", "--help")):
        return ["bench", "spec", *argv[1:]]
    return argv


def _every_flag(a: argparse.Namespace) -> argparse.Namespace:
    """The mode's flags, and every other mode's at its default: the runners share helpers."""
    defaults = {}
    for names, kwargs, _ in _FLAGS:
        dest = names[-1].lstrip("-").replace("-", "_")
        defaults[dest] = kwargs.get("default", False if kwargs.get("action") == "store_true" else None)
    return argparse.Namespace(**{**defaults, **vars(a)})


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
    a = _with_mode_defaults(_every_flag(a))
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
