"""`specdec check-lossless`: a statistical test that speculative sampling keeps the target's distribution.

At temperature > 0 speculative output cannot equal plain output token for token, so we draw many
independent samples per prompt from plain and from speculative decoding (fixed per-sample seeds,
different streams per arm) and compare, position by position from position 2 (position 1 comes from
prefill, never from a draft), the distribution over the plain arm's top-20 tokens plus "other", and
for each two consecutive positions the joint distribution over the top-20 pairs plus "other". Each
table gets a two-sample chi-square test of homogeneity; the check passes when every p-value is above
alpha / number_of_tests (Bonferroni). It knows nothing of how the engine drafts or verifies: it only
sees generated token ids, so any proposer (n-gram, draft model) can be checked.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.quality.chi_square import chi_square_two_sample
from specdec.sample.rejection_sampler import rejection_sample
from specdec.sample.verifier import Sampler

if TYPE_CHECKING:
    from specdec.config import SpeculativeConfig
    from specdec.models.loader import LoadedModel
    from specdec.sampling_params import SamplingParams

LOSSLESS_TARGET = "qwen2.5-coder-0.5b-instruct"
NUM_BINS = 20       # top tokens (or pairs) of the plain arm; the rest pool into "other"
BLOCK_SIZE = 16
# n-gram lookup drafts at position 2 for most samples (the first token repeats a word of the prompt)
# while the target is unsure there (p(draft) about 0.55-0.7 at temperature 1); 17 tokens each, so
# with 16-token blocks the prefix cache leaves one prompt token per sample to recompute.
DEFAULT_PROMPTS = (
    "And then she said yes. He said no. She said maybe. Then he said",
    "Then she said yes. He said no. She said maybe. Then he said no",
)


@dataclass
class ArmSamples:
    """One arm's generated ids: token_ids[prompt][sample] holds positions 1..max_tokens."""
    method: str                       # "plain" | "ngram" | "draft_model"
    prompt_ids: list[list[int]]
    sampling: tuple[float, float, int]  # (temperature, top_p, top_k): what a reused arm must match
    token_ids: list[list[list[int]]]
    drafted_tokens: list[int]         # per prompt, summed over samples
    accepted_tokens: list[int]
    seconds: float


@dataclass
class PositionTest:
    prompt_index: int
    positions: list[int]  # [j] (one position) or [j, j + 1] (joint)
    statistic: float
    df: int
    p_value: float
    num_bins: int


@dataclass
class LosslessReport:
    target: str
    method: str
    draft: str | None
    k: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    prompts: list[str]
    positions: list[int]
    num_samples_plain: int          # per prompt
    num_samples_spec: int
    drafted_tokens: list[int]       # speculative arm, per prompt
    accepted_tokens: list[int]
    tests: list[PositionTest]
    alpha: float
    threshold: float                # alpha / len(tests)
    passed: bool
    plain_seconds: float
    spec_seconds: float
    broken_sampler: str | None = None
    coupling: str = "gumbel"        # how the speculative arm verified its sampled drafts
    plain: ArmSamples | None = field(default=None, repr=False)  # raw samples, for reuse; not in JSON
    spec: ArmSamples | None = field(default=None, repr=False)

    @property
    def min_p_value(self) -> float:
        return min(t.p_value for t in self.tests)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["plain"], d["spec"]
        return d

    def table(self) -> str:
        lines = [f"{'prompt':>6}  {'positions':>9}  {'chi2':>9}  {'df':>3}  {'p-value':>9}  drafted/accepted"]
        for t in self.tests:
            i = t.prompt_index
            lines.append(f"{i:>6}  {'+'.join(map(str, t.positions)):>9}  {t.statistic:9.2f}  {t.df:>3}  "
                         f"{t.p_value:9.3g}  {self.drafted_tokens[i]}/{self.accepted_tokens[i]}"
                         + ("  <-- below threshold" if t.p_value <= self.threshold else ""))
        return "\n".join(lines)

    def verdict(self) -> str:
        rule = (f"every p-value > alpha / tests = {self.alpha:g} / {len(self.tests)} = {self.threshold:.3g} "
                f"(Bonferroni)")
        what = (f"{self.method} k={self.k} vs plain, {self.num_samples_spec} vs {self.num_samples_plain} samples "
                f"per prompt, {len(self.prompts)} prompt(s), min p {self.min_p_value:.3g}")
        return f"{'PASS' if self.passed else 'FAIL'}: {what}; rule: {rule}"


def sample_arm(target: LoadedModel, prompt_ids: list[list[int]], params: SamplingParams, *,
               speculative: SpeculativeConfig | None, draft: LoadedModel | None = None, num_samples: int,
               seeds: list[int], max_batch_size: int = 64, num_threads: int | None = None,
               progress: bool = True, sampler: Sampler = rejection_sample, coupling: str = "gumbel") -> ArmSamples:
    """num_samples generations per prompt with `params` (its seed replaced: sample i of prompt j gets
    seeds[j * num_samples + i]). All requests are submitted at once; a warm-up request per prompt
    fills the prefix cache first, so each sample recomputes only the prompt's uncached tail."""
    from tqdm import tqdm

    from specdec.config import CacheConfig, EngineConfig, SamplingConfig, SchedulerConfig
    from specdec.llm import LLM

    k = speculative.num_speculative_tokens if speculative else 0
    longest = max(map(len, prompt_ids))
    per_request = -(-(longest + params.max_tokens + k + 1) // BLOCK_SIZE) + 1
    blocks = (max_batch_size + len(prompt_ids)) * per_request + 16
    config = EngineConfig(
        model=_model_config(target, num_threads),
        cache=CacheConfig(block_size=BLOCK_SIZE, target_cache_blocks=blocks, draft_cache_blocks=blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(512, max_batch_size * (k + 1) + longest),
                                  max_batch_size=max_batch_size, max_queued_requests=num_samples * len(prompt_ids)),
        speculative=speculative, sampling=SamplingConfig(coupling))
    llm = LLM(config=config, loaded=target, draft_loaded=draft, progress=False, rejection_sampler=sampler)
    engine = llm.engine
    llm.generate(prompt_ids, replace(params, max_tokens=1, seed=0))  # warm the prefix cache

    method = speculative.method if speculative else "plain"
    t0 = time.perf_counter()
    where: dict[str, tuple[int, int]] = {}
    for j, ids in enumerate(prompt_ids):
        for i in range(num_samples):
            request = engine.add_request(ids, replace(params, seed=seeds[j * num_samples + i]))
            where[request.request_id] = (j, i)
    token_ids: list[list[list[int]]] = [[[] for _ in range(num_samples)] for _ in prompt_ids]
    drafted, accepted = [0] * len(prompt_ids), [0] * len(prompt_ids)
    with tqdm(total=len(where), desc=f"check-lossless: {method}", unit="sample", file=sys.stderr,
              disable=not progress) as bar:
        while where:
            for out in engine.step():
                if out.finished and out.request_id in where:
                    j, i = where.pop(out.request_id)
                    token_ids[j][i] = list(out.token_ids)
                    drafted[j] += out.stats.drafted_tokens
                    accepted[j] += out.stats.accepted_tokens
                    bar.update()
    return ArmSamples(method, prompt_ids, _sampling(params), token_ids, drafted, accepted, time.perf_counter() - t0)


def _sampling(params: SamplingParams) -> tuple[float, float, int]:
    return (params.temperature, params.top_p, params.top_k)


def _model_config(target: LoadedModel, num_threads: int | None):
    """The ModelConfig that matches weights already loaded (their precision and device)."""
    from specdec.config import ModelConfig
    device = str(target.weights["layers.0.input_norm"].device)
    return ModelConfig(model=target.name, precision=target.precision, device=device, num_threads=num_threads)


def arm_seeds(seed: int, arm: str, n: int) -> list[int]:
    """n distinct per-sample seeds for one arm; arms draw from separate streams, so they are independent."""
    return random.Random(f"specdec-lossless/{seed}/{arm}").sample(range(2**62), n)


def compare_arms(plain: ArmSamples, spec: ArmSamples, positions: Sequence[int]) -> list[PositionTest]:
    """One test per (prompt, position) and per (prompt, consecutive pair of positions), binned over the
    plain arm's top-20 tokens (or pairs) plus "other"."""
    groups = [[p] for p in positions] + [[p, p + 1] for p in positions if p + 1 in positions]
    tests = []
    for j, (ref, cand) in enumerate(zip(plain.token_ids, spec.token_ids)):
        for group in groups:
            ref_counts = Counter(tuple(ids[p - 1] for p in group) for ids in ref)
            cand_counts = Counter(tuple(ids[p - 1] for p in group) for ids in cand)
            bins = [b for b, _ in ref_counts.most_common(NUM_BINS)]
            ref_binned = [ref_counts[b] for b in bins]
            cand_binned = [cand_counts[b] for b in bins]
            r = chi_square_two_sample(ref_binned + [len(ref) - sum(ref_binned)],
                                      cand_binned + [len(cand) - sum(cand_binned)])
            tests.append(PositionTest(j, group, r.statistic, r.df, r.p_value, r.num_bins))
    return tests


def check_lossless(target: LoadedModel, prompts: Sequence[str] = DEFAULT_PROMPTS, *, method: str = "ngram",
                   draft: LoadedModel | None = None, k: int = 3, num_samples: int = 2000,
                   positions: Sequence[int] = (2, 3), temperature: float = 1.0, top_p: float = 1.0,
                   top_k: int = 0, seed: int = 0, alpha: float = 0.01, chat: bool = False,
                   max_batch_size: int = 64, num_threads: int | None = None, progress: bool = True,
                   plain: ArmSamples | None = None, sampler: Sampler = rejection_sample,
                   coupling: str = "gumbel") -> LosslessReport:
    """Sample plain and speculative decoding (policy "fixed", so every step drafts what it can) and test
    that they agree at each position. max_tokens = max(positions): a draft then covers positions
    2..max-1 and the last position is a bonus or plain token, which the joint test checks.

    Args:
        target: the target's weights (both arms share them).
        draft: the draft model's weights, for method "draft_model".
        num_samples: samples per prompt and arm.
        plain: the plain arm of an earlier report with the same prompts and settings, to reuse.
        sampler: the rejection sampler of the speculative arm (a test injects a broken one to show the
            check has power; the report then names it).
        coupling: how the speculative arm verifies sampled drafts ("gumbel" or "rejection"; `sampler`
            runs under "rejection" only).
    Returns:
        The report; raises ValueError on bad arguments, or when the speculative arm drafted nothing
        (the comparison would be vacuous).
    """
    from specdec.config import SpeculativeConfig
    from specdec.sampling_params import SamplingParams

    positions = _validate(positions, temperature, num_samples, len(prompts), alpha, k)
    if method == "draft_model" and draft is None:
        raise ValueError("method draft_model needs the draft model's weights")
    spec_cfg = SpeculativeConfig(method=method, draft_model=draft.name if draft else None,
                                 num_speculative_tokens=k, policy="fixed")
    tok = target.tokenizer
    if chat:
        prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                      for p in prompts]
    else:
        prompt_ids = [tok.encode(p) for p in prompts]
    # ignore_eos: every sample reaches every position
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=positions[-1],
                            ignore_eos=True)
    common = {"max_batch_size": max_batch_size, "num_threads": num_threads, "progress": progress}
    if plain is None:
        plain = sample_arm(target, prompt_ids, params, speculative=None, num_samples=num_samples,
                           seeds=arm_seeds(seed, "plain", num_samples * len(prompts)), **common)
    elif (plain.prompt_ids != prompt_ids or plain.sampling != _sampling(params)
          or len(plain.token_ids[0][0]) < positions[-1]):
        raise ValueError("the plain arm given was sampled with other prompts, sampling settings or positions")
    spec = sample_arm(target, prompt_ids, params, speculative=spec_cfg, draft=draft, num_samples=num_samples,
                      seeds=arm_seeds(seed, "spec", num_samples * len(prompts)), sampler=sampler,
                      coupling=coupling, **common)
    if sum(spec.drafted_tokens) == 0:
        raise ValueError(f"the {method} arm drafted no tokens at positions 2..{positions[-1]}: the check would be "
                         "vacuous; use prompts whose continuation the proposer can draft")
    tests = compare_arms(plain, spec, positions)
    threshold = alpha / len(tests)
    return LosslessReport(
        target=target.name, method=method, draft=draft.name if draft else None, k=k, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, prompts=list(prompts), positions=positions,
        num_samples_plain=len(plain.token_ids[0]), num_samples_spec=num_samples,
        drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens, tests=tests, alpha=alpha,
        threshold=threshold, passed=all(t.p_value > threshold for t in tests), plain_seconds=plain.seconds,
        spec_seconds=spec.seconds, broken_sampler=None if sampler is rejection_sample else sampler.__name__,
        coupling=coupling,
        plain=plain, spec=spec)


def cmd_check_lossless(a: argparse.Namespace) -> int:
    from specdec.fileio import atomic_write_text
    from specdec.models.loader import load_model
    from specdec.models.registry import default_draft
    from specdec.prompts import read_prompts_file

    prompts = read_prompts_file(a.prompts_file) if a.prompts_file else list(DEFAULT_PROMPTS)
    # fail before loading weights and minutes of sampling, not after
    positions = _validate(_parse_positions(a.positions), a.temperature, a.samples, len(prompts), a.alpha, a.k)
    draft_name = a.draft
    if a.spec == "draft_model" and draft_name is None:
        draft_name = default_draft(a.model)
        if draft_name is None:
            raise ValueError(f"{a.model} has no default draft model; name one with --draft")
    if draft_name and a.spec != "draft_model":
        raise ValueError("--draft goes with --spec draft_model")
    target = load_model(a.model, a.precision, a.device, progress=True)
    draft = load_model(draft_name, a.precision, a.device, progress=True) if draft_name else None
    report = check_lossless(target, prompts, method=a.spec, draft=draft, k=a.k, num_samples=a.samples,
                            positions=positions, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, alpha=a.alpha, chat=a.chat, max_batch_size=a.max_batch_size,
                            num_threads=a.threads, coupling=a.coupling)
    for i, p in enumerate(prompts):
        print(f"prompt {i}: {json.dumps(p, ensure_ascii=False)[:100]}")
    print(report.table())
    if a.out:
        atomic_write_text(Path(a.out), json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {a.out}", file=sys.stderr)
    print(report.verdict(), flush=True)
    return 0 if report.passed else 1


def _validate(positions: Sequence[int], temperature: float, num_samples: int, num_prompts: int, alpha: float,
              k: int) -> list[int]:
    """The sorted positions; ValueError on any argument that would make the check meaningless."""
    positions = sorted(set(positions))
    if not positions or positions[0] < 2:
        raise ValueError("positions start at 2 (the first token comes from prefill, never from a draft)")
    if not temperature > 0:
        raise ValueError("temperature must be > 0 (greedy output is compared exactly, not statistically)")
    if num_samples < 1 or num_prompts < 1:
        raise ValueError("need at least one prompt and one sample")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if k < 1:
        raise ValueError("k must be >= 1: with k = 0 nothing is drafted")
    return positions


def _parse_positions(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--positions takes comma-separated integers, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    """Add `check-lossless` to the `specdec` CLI."""
    from specdec.config import COUPLINGS, PRECISIONS
    c = sub.add_parser("check-lossless", help="statistical test: speculative sampling matches plain sampling")
    c.add_argument("--model", default=LOSSLESS_TARGET, help="target: registry name, .gguf path or model folder")
    c.add_argument("--spec", choices=["ngram", "draft_model"], default="ngram")
    c.add_argument("--draft", default=None, help="draft model for --spec draft_model (default: the registry's)")
    c.add_argument("-k", type=int, default=3,
                   help="drafts per step (policy fixed), capped by the tokens left before the last position")
    c.add_argument("--samples", type=int, default=2000, help="samples per prompt and arm")
    c.add_argument("--positions", default="2,3", help="positions to test, from 2 (consecutive ones also jointly)")
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--seed", type=int, default=0, help="fixes every sample's seed in both arms")
    c.add_argument("--coupling", choices=COUPLINGS, default="gumbel",
                   help="how the speculative arm verifies sampled drafts (gumbel: Gumbel coupling; rejection: "
                        "rejection sampling)")
    c.add_argument("--alpha", type=float, default=0.01, help="family-wise significance level (Bonferroni)")
    c.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line (default: built-in prompts)')
    c.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    c.add_argument("--precision", "--dtype", dest="precision", default="float32", choices=PRECISIONS)
    c.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    c.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    c.add_argument("--max-batch-size", type=int, default=64, help="running requests per step")
    c.add_argument("--out", default=None, help="write the report as JSON here")
    c.set_defaults(func=cmd_check_lossless)
