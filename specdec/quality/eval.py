"""`specdec eval`: A/B quality of candidate configurations against plain float32 decoding.

Each prompt runs through the reference (plain@float32) and every candidate (`method@precision`,
method plain | draft_model | ngram), greedily, one prompt at a time (latency at batch 1), arms
interleaved per prompt in an order that rotates, all on weights loaded once per precision. Then,
with no timing running: perplexity of every output under the float32 target (the reference engine
scores it), ROUGE-L / BLEU / exact match against the reference output and, with --similarity, the
embedding cosine of the optional monitor. Speculative decoding at greedy reproduces plain decoding
at the same precision token for token, so those rows are a check; precision modes are where the
quality numbers move. Writes eval.json, eval.md and PNG plots (see report.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.config import PRECISIONS, SPEC_POLICIES
from specdec.extras import require

if TYPE_CHECKING:  # the CLI imports this module to register the subcommand: keep that light
    from specdec.engine import LLMEngine
    from specdec.llm import LLM
    from specdec.models.tokenizer import Tokenizer

METHODS = ("plain", "draft_model", "ngram")
REFERENCE = "plain@float32"
DEFAULT_CANDIDATES = "draft_model@float32,ngram@float32,plain@bfloat16,draft_model@bfloat16"
WARMUP_PROMPT = "Hello"  # not from any set, so warming up caches no prefix of a measured prompt


@dataclass(frozen=True)
class Arm:
    """One configuration under test, named `method@precision`."""
    method: str      # "plain" | "draft_model" | "ngram"
    precision: str   # "float32" | "bfloat16"

    @property
    def name(self) -> str:
        return f"{self.method}@{self.precision}"

    @classmethod
    def parse(cls, text: str) -> Arm:
        method, _, precision = text.strip().partition("@")
        precision = precision or "float32"
        if method not in METHODS or precision not in PRECISIONS:
            raise ValueError(f"bad candidate {text!r}: expected method@precision with method in "
                             f"{', '.join(METHODS)} and precision in {', '.join(PRECISIONS)}")
        return cls(method, precision)


@dataclass
class EvalPrompt:
    set: str
    index: int             # position in its set's file
    text: str
    token_ids: list[int]   # what the engines see (chat template applied with --chat)


def parse_candidates(text: str) -> list[Arm]:
    """`draft_model@float32,plain@bfloat16` -> arms, in order, without duplicates."""
    arms = [Arm.parse(t) for t in text.split(",") if t.strip()]
    if not arms:
        raise ValueError("no candidates given")
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"candidate(s) listed twice: {', '.join(dup)}")
    return arms


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommand to the `specdec` CLI."""
    from specdec.config import DEFAULT_TARGET
    e = sub.add_parser("eval", help="A/B quality: candidate configurations against plain float32 decoding")
    e.add_argument("--model", default=DEFAULT_TARGET, help="target: registry name, .gguf path or model folder")
    e.add_argument("--draft", default=None, help="draft for draft_model candidates (default: the registry's)")
    e.add_argument("--candidates", default=DEFAULT_CANDIDATES,
                   help=f"comma-separated method@precision (the reference is always {REFERENCE})")
    e.add_argument("--sets", default="code_gen,chat", help="prompt sets from specdec/bench/prompts")
    e.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap each prompt in the model's chat template (default on)")
    e.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=4)
    e.add_argument("--spec-policy", choices=SPEC_POLICIES, default="cost_model")
    e.add_argument("--similarity", action="store_true",
                   help="also report embedding cosine similarity (needs pip install 'specdec[monitor]')")
    e.add_argument("--device", default="cpu")
    e.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    e.add_argument("--out-dir", default="eval", help="writes eval.json, eval.md and eval*.png here")
    e.set_defaults(func=cmd_eval)


def cmd_eval(a: argparse.Namespace) -> int:
    run_eval(a)
    return 0


def read_sets(sets: list[str], num_prompts: int) -> list[tuple[str, int, str]]:
    """(set, index, text) of the first num_prompts prompts of each named set."""
    from specdec.prompts import available_sets, read_set
    available = available_sets()
    unknown = [s for s in sets if s not in available]
    if unknown or not sets:
        raise ValueError(f"unknown prompt set(s) {unknown or sets}; choose from {', '.join(available)}")
    return [(s, i, text) for s in sets
            for i, text in enumerate(read_set(s)[:num_prompts])]


def tokenize_prompts(texts: list[tuple[str, int, str]], tokenizer: Tokenizer, chat: bool) -> list[EvalPrompt]:
    """Token ids as the engines will see them (chat template applied with chat=True)."""
    prompts = []
    for s, i, text in texts:
        if chat:
            ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        prompts.append(EvalPrompt(s, i, text, ids))
    return prompts


def _build_llms(a: argparse.Namespace, arms: list[Arm]) -> tuple[dict[str, LLM], str | None, float]:
    """One LLM per arm; weights loaded once per (model, precision). Returns (llms, draft, seconds)."""
    from specdec.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
    from specdec.llm import LLM
    from specdec.models.loader import load_model
    from specdec.models.registry import default_draft

    t0 = time.perf_counter()
    targets = {p: load_model(a.model, p, a.device, progress=False, pull=True)
               for p in dict.fromkeys(x.precision for x in arms)}
    draft_name = a.draft or default_draft(targets["float32"].name)
    if any(x.method == "draft_model" for x in arms) and not draft_name:
        raise ValueError(f"{a.model} has no default draft: pass --draft or drop the draft_model candidates")
    drafts = {p: load_model(draft_name, p, a.device, progress=False, pull=True)
              for p in dict.fromkeys(x.precision for x in arms if x.method == "draft_model")}
    llms = {}
    for arm in arms:
        spec = None
        if arm.method != "plain":
            spec = SpeculativeConfig(method=arm.method, num_speculative_tokens=a.k, policy=a.spec_policy,
                                     draft_model=draft_name if arm.method == "draft_model" else None)
        cfg = EngineConfig(model=ModelConfig(model=targets[arm.precision].name, precision=arm.precision,
                                             device=a.device, num_threads=a.threads),
                           cache=CacheConfig(target_cache_blocks=512, draft_cache_blocks=512), speculative=spec)
        llms[arm.name] = LLM(config=cfg, loaded=targets[arm.precision], draft_loaded=drafts.get(arm.precision),
                             progress=False)
    return llms, (draft_name if drafts else None), time.perf_counter() - t0


def _first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix); None if equal."""
    if reference == candidate:
        return None
    return next((i for i, (r, c) in enumerate(zip(reference, candidate)) if r != c),
                min(len(reference), len(candidate)))


def run_eval(a: argparse.Namespace) -> dict:
    """Run the A/B evaluation the flags describe; write the report files; return the JSON report."""
    from specdec.quality import report

    if a.num_prompts < 1 or a.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be at least 1")
    for module in ("rouge_score", "sacrebleu", "matplotlib"):  # the scores and the report's plots
        require(module, "bench", "specdec eval")
    arms = [Arm.parse(REFERENCE)] + parse_candidates(a.candidates)
    if arms.count(arms[0]) > 1:
        raise ValueError(f"{REFERENCE} is the reference; it cannot also be a candidate")
    sets = [s.strip() for s in a.sets.split(",") if s.strip()]
    texts = read_sets(sets, a.num_prompts)
    if a.similarity:  # fail before minutes of generation, not after
        from specdec.quality.similarity import model_dir
        try:
            model_dir()
        except ImportError as e:
            raise ValueError(str(e)) from e
    llms, draft_name, load_seconds = _build_llms(a, arms)
    ref_llm = llms[REFERENCE]
    prompts = tokenize_prompts(texts, ref_llm.tokenizer, a.chat)
    runs = _generate(llms, arms, prompts, a.max_tokens)
    _compare(runs, prompts, ref_llm.engine, a.similarity)

    result = {"model": ref_llm.engine.loaded.name, "draft": draft_name, "reference": REFERENCE,
              "candidates": [x.name for x in arms[1:]], "k": a.k, "spec_policy": a.spec_policy,
              "max_tokens": a.max_tokens, "chat": a.chat, "sets": sets, "num_prompts_per_set": a.num_prompts,
              "device": a.device, "similarity": bool(a.similarity), "load_seconds": load_seconds,
              "noisy_runs": sum(r["noisy"] for r in runs), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
              **report.summarize(runs, [x.name for x in arms], sets), "runs": runs}
    paths = report.write(result, Path(a.out_dir))
    report.print_table(result, file=sys.stdout)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return result


def _generate(llms: dict[str, LLM], arms: list[Arm], prompts: list[EvalPrompt], max_tokens: int) -> list[dict]:
    """Every prompt through every arm, greedily at batch 1; one record per (prompt, arm)."""
    from tqdm import tqdm

    from specdec.contention import Contention
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for llm in llms.values():  # first-call costs (allocations, thread pools) stay out of the timings
        llm.generate([WARMUP_PROMPT], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    runs: list[dict] = []
    bar = tqdm(total=len(prompts) * len(arms), desc="eval: generate", file=sys.stderr)
    for n, p in enumerate(prompts):
        order = arms[n % len(arms):] + arms[: n % len(arms)]  # rotate: no arm always runs first
        for arm in order:
            with Contention() as busy:
                out = llms[arm.name].generate([p.token_ids], params, batch=False)[0]
            st = out.stats
            runs.append({"set": p.set, "prompt": p.index, "arm": arm.name, "method": arm.method,
                         "precision": st.precision, "proposer": st.proposer, "text": out.text,
                         "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                         "prompt_tokens": st.prompt_tokens, "generated_tokens": st.generated_tokens,
                         "tokens_per_second": st.tokens_per_second, "drafted_tokens": st.drafted_tokens,
                         "accepted_tokens": st.accepted_tokens, "acceptance_rate": st.acceptance_rate,
                         "mean_accepted_length": st.mean_accepted_length, "noisy": busy.noisy,
                         "competing_cores": busy.cores, "_n": n})
            bar.update(1)
    bar.close()
    return runs


def _compare(runs: list[dict], prompts: list[EvalPrompt], ref_engine: LLMEngine, similarity: bool) -> None:
    """Add to each record its perplexity under the float32 target and its agreement with the
    reference output of the same prompt (exact match, divergence, ROUGE-L, BLEU, speedup)."""
    from tqdm import tqdm

    from specdec.quality.scoring import perplexity, score_tokens
    from specdec.quality.text_metrics import rouge_l, sentence_bleu

    by_key = {(r["_n"], r["arm"]): r for r in runs}
    scored: dict[tuple[int, tuple[int, ...]], float | None] = {}  # identical outputs are scored once
    for r in tqdm(runs, desc="eval: perplexity (float32 target)", file=sys.stderr):
        key = (r["_n"], tuple(r["token_ids"]))
        if key not in scored:
            scored[key] = perplexity(score_tokens(ref_engine, prompts[r["_n"]].token_ids, r["token_ids"]))
        r["perplexity"] = scored[key]
    for r in runs:
        ref = by_key[(r["_n"], REFERENCE)]
        r["exact_match"] = r["token_ids"] == ref["token_ids"]
        r["first_divergence"] = _first_divergence(ref["token_ids"], r["token_ids"])
        r["rouge_l"] = rouge_l(ref["text"], r["text"])
        r["bleu"] = sentence_bleu(ref["text"], r["text"])
        r["speedup"] = r["tokens_per_second"] / ref["tokens_per_second"]
        # speculative vs plain at the same precision: identical by construction at greedy
        plain = by_key.get((r["_n"], f"plain@{r['precision']}"))
        r["identical_to_plain_same_precision"] = (None if r["method"] == "plain" or plain is None
                                                  else r["token_ids"] == plain["token_ids"])
        r["similarity"] = None
    if similarity:
        _add_similarity(runs, by_key)
    for r in runs:
        del r["_n"]


def _add_similarity(runs: list[dict], by_key: dict[tuple[int, str], dict]) -> None:
    """Cosine of each output's embedding with its reference's (the optional monitor)."""
    from specdec.quality.similarity import SimilarityModel
    model = SimilarityModel.load()
    refs = [by_key[(r["_n"], REFERENCE)]["text"] for r in runs]
    for r, sim in zip(runs, model.cosine(refs, [r["text"] for r in runs])):
        r["similarity"] = sim
