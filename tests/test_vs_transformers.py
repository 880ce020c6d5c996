"""Our forward pass and greedy decoding against transformers, both reading the SAME GGUF file in float32.

transformers is the test oracle only (the engine never imports it). For each real model (Qwen2.5-Coder 0.5B,
a `qwen2` GGUF, and SmolLM2-135M, a `llama` GGUF whose Q/K rows llama.cpp interleaves):

1. full-sequence logits of a code, a prose and a Chinese prompt agree to 1e-3 everywhere;
2. greedy continuations equal transformers' `generate(do_sample=False)` token for token, up to the first step
   where transformers' own top-2 logit gap is below 1e-3 (past such a near-tie the two may legitimately part).

Run with `-s` (or `-rP`) to see the measured max |delta| and the near-tie counts.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import engine_config

from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.llm import LLM
from specdec.models.llama import LlamaModel
from specdec.runner.model_runner import ModelRunner
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

LOGIT_ATOL = 1e-3
NEAR_TIE = 1e-3          # transformers' top-2 logit gap below which a greedy step may go either way
NEW_TOKENS = 24
BLOCK_SIZE = 16

# registry name -> the conftest session fixture that loads it with our loader
MODELS = {"qwen2.5-coder-0.5b-instruct": "qwen05_loaded", "smollm2-135m-instruct": "smollm_loaded"}

CODE = ('def quicksort(arr):\n    """Sort a list of numbers."""\n    if len(arr) <= 1:\n        return arr\n'
        '    pivot = arr[len(arr) // 2]\n    left = [x for x in arr if x < pivot]\n')
PROSE = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father "
         "had taught him, and lit the lamp before the fog rolled in from the sea.")
CHINESE = "春天来了，公园里的花都开了。孩子们在草地上放风筝，老人们坐在长椅上聊天。"

LOGIT_PROMPTS = {"code": CODE, "prose": PROSE, "chinese": CHINESE}
GREEDY_PROMPTS = {
    "code": "def is_prime(n: int) -> bool:\n",
    "prose": "Once upon a time, in a small village at the edge of a great forest,",
    "chinese": "请用三句话介绍一下长城。",
    "chat": None,  # built from the model's own chat template
}
CHAT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@dataclass
class Pair:
    name: str
    ours: Any          # specdec LoadedModel
    hf: Any            # transformers model; None once torn down


@contextlib.contextmanager
def _gguf_loading_shortcuts():
    """What `from_pretrained(..., gguf_file=...)` needs here, changing nothing it computes.

    - transformers 5.24 refuses every GGUF load unless `accelerate` is importable, yet a CPU load without a
      device_map never touches accelerate: `llama`/`qwen2` GGUFs go through the legacy
      `modeling_gguf_pytorch_utils.load_gguf_checkpoint`, plain gguf + numpy + torch. accelerate is not installed
      in this venv (and the engine does not need it), so the gate is lifted for the call when it is missing.
    - That path parses the whole file with `gguf.GGUFReader` twice (once for the config, once for the tensors;
      ~150k vocabulary strings each time for Qwen) and rebuilds `gguf.get_tensor_name_map` for every submodule.
      Both are pure functions of their arguments, so they are memoized for the duration of the load.
    """
    import gguf
    from transformers import modeling_utils
    from transformers.utils import is_accelerate_available

    real_reader = gguf.GGUFReader
    readers: dict[tuple, Any] = {}

    def cached_reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(pytest.MonkeyPatch.context())
        patch.setattr(gguf, "GGUFReader", cached_reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        if not is_accelerate_available():
            patch.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        try:
            yield
        finally:
            readers.clear()


def _load_transformers(ours) -> Any:
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM  # the `test` extra

    path = ours.path  # the very file our loader read
    with _gguf_loading_shortcuts():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager")
    model.eval()
    # ignore_eos on the transformers side: no EOS stopping criterion at all (EOS may still be chosen)
    model.generation_config.eos_token_id = None
    return model


def _check_same_hyperparameters(ours, hf) -> None:
    """Fail early, with a readable message, when the two read the GGUF's metadata differently."""
    c, h = ours.config, hf.config
    rope = getattr(h, "rope_parameters", None) or {}
    theirs = {
        "vocab_size": h.vocab_size, "hidden_size": h.hidden_size, "intermediate_size": h.intermediate_size,
        "num_layers": h.num_hidden_layers, "num_heads": h.num_attention_heads,
        "num_kv_heads": h.num_key_value_heads,
        "head_dim": getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads,
        "rope_theta": rope.get("rope_theta", getattr(h, "rope_theta", None)),
        "rms_norm_eps": h.rms_norm_eps, "tie_embeddings": h.tie_word_embeddings,
    }
    mine = {k: getattr(c, k) for k in theirs}
    same = all(abs(mine[k] - theirs[k]) <= 1e-6 * abs(theirs[k]) if isinstance(theirs[k], float)
               else mine[k] == theirs[k] for k in theirs)
    assert same, f"hyperparameters differ: ours {mine}, transformers {theirs}"


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread():
    """Run this module's forwards on one intra-op thread, then restore the setting.

    The comparison does not depend on it (only summation order changes, far below the tolerances). It is for
    time: on a 2-core machine that other jobs share, every small multi-threaded op (eager attention's matmul and
    softmax, run thousands of times by `generate`) waits for a descheduled OpenMP worker. Measured with the
    machine loaded: transformers' 24-token greedy on SmolLM2 took 41.7 s with 2 threads, 5.3 s with 1."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(MODELS), ids=["qwen05", "smollm135"])
def pair(request):
    """Our LoadedModel and transformers' model of the same GGUF; one transformers model alive at a time."""
    name = request.param
    ours = request.getfixturevalue(MODELS[name])
    t0 = time.perf_counter()
    hf = _load_transformers(ours)
    print(f"\n[{name}] transformers loaded {ours.path.name} in {time.perf_counter() - t0:.1f}s")
    _check_same_hyperparameters(ours, hf)
    p = Pair(name, ours, hf)
    yield p
    p.hf = None  # the fixture cache still holds `p`: drop the model itself
    del hf
    gc.collect()


def _our_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    blocks = list(range(-(-n // BLOCK_SIZE)))
    chunk = ScheduledChunk("vs-transformers", ids, 0, blocks, num_logits=n)
    return runner.execute(SchedulerOutput(chunks=[chunk], num_batched_tokens=n)).logits


def test_full_sequence_logits_match_transformers(pair):
    ours, hf = pair.ours, pair.hf
    tok = ours.tokenizer
    prompts = {k: tok.encode(v) for k, v in LOGIT_PROMPTS.items()}
    max_len = max(len(ids) for ids in prompts.values())
    model = LlamaModel(ours.config, ours.weights, max_len, torch.device("cpu"))
    runner = ModelRunner(model, -(-max_len // BLOCK_SIZE), BLOCK_SIZE, torch.device("cpu"))

    per_prompt = {}
    for key, ids in prompts.items():
        assert len(ids) >= 16, f"{key}: prompt too short ({len(ids)} tokens)"
        mine = _our_logits(runner, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert mine.shape == ref.shape == (len(ids), ours.config.vocab_size)
        assert torch.isfinite(ref).all()
        kept = torch.isfinite(mine)  # -inf columns on our side (none without never_sample_ids) are not compared
        assert kept.any(dim=1).all()
        delta = (mine - ref).abs().masked_fill(~kept, 0.0)
        worst = delta.max().item()
        per_prompt[key] = (len(ids), worst)
        row, col = divmod(int(delta.argmax()), delta.shape[1])
        assert worst <= LOGIT_ATOL, (
            f"{pair.name} {key}: max |delta| {worst:.3g} at position {row}/{len(ids)}, token {col} "
            f"(ours {mine[row, col].item():.5f}, transformers {ref[row, col].item():.5f}); "
            f"argmax agreement {(mine.argmax(-1) == ref.argmax(-1)).float().mean().item():.2f}")

    overall = max(w for _, w in per_prompt.values())
    detail = ", ".join(f"{k} ({n} tok) {w:.2e}" for k, (n, w) in per_prompt.items())
    print(f"\n[{pair.name}] logits max |delta| = {overall:.3e} over all positions and {ours.config.vocab_size} "
          f"columns ({detail})")


def _transformers_greedy(hf, ids: list[int]) -> tuple[list[int], list[float], list[int]]:
    """transformers' greedy continuation, its top-2 logit gap at each step, and its raw argmax at each step."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    top2 = [step[0].float().topk(2) for step in out.logits]
    gaps = [(v[0] - v[1]).item() for v, _ in top2]
    argmax = [int(i[0]) for _, i in top2]
    return tokens, gaps, argmax


def test_greedy_matches_transformers_generate(pair):
    ours, hf = pair.ours, pair.hf
    tok = ours.tokenizer
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    prompts = {k: tok.encode(v if v is not None else chat, add_special_tokens=v is not None)
               for k, v in GREEDY_PROMPTS.items()}
    llm = LLM(config=engine_config(ours.name), loaded=ours, progress=False)
    masked = set(tok.never_sample_ids)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(list(prompts.values()), params)

    full, cuts, lines = 0, [], []
    for (key, ids), out in zip(prompts.items(), outs):
        mine = out.token_ids
        ref, gaps, argmax = _transformers_greedy(hf, ids)
        assert len(mine) == len(ref) == NEW_TOKENS, (key, len(mine), len(ref))
        # compare up to (not including) the first near-tie, or the first token our engine may never sample
        cut = next((i for i, g in enumerate(gaps) if g < NEAR_TIE or ref[i] in masked), NEW_TOKENS)
        # transformers really decoded greedily on its raw logits where the choice was clear
        assert ref[:cut] == argmax[:cut], f"{pair.name} {key}: transformers' generate was not plain greedy"
        first_diff = next((i for i in range(cut) if mine[i] != ref[i]), None)
        assert first_diff is None, (
            f"{pair.name} {key}: greedy tokens differ at step {first_diff} (transformers' top-2 gap there "
            f"{gaps[first_diff]:.3g}): ours {mine[first_diff:cut]} vs transformers {ref[first_diff:cut]}; "
            f"texts {tok.decode(mine)!r} vs {tok.decode(ref)!r}")
        if cut == NEW_TOKENS:
            full += 1
            lines.append(f"{key}: {NEW_TOKENS}/{NEW_TOKENS} equal (min gap {min(gaps):.3g})")
        else:
            why = "never-sample id" if ref[cut] in masked else f"near-tie gap {gaps[cut]:.2g}"
            cuts.append((key, cut))
            lines.append(f"{key}: cut at step {cut} by {why}; {cut} equal before it; "
                         f"{'same' if mine[cut:] == ref[cut:] else 'different'} after")

    print(f"\n[{pair.name}] greedy {NEW_TOKENS} tokens on {len(prompts)} prompts: {full} compared over the full "
          f"length, {len(cuts)} cut early (near-tie or never-sample id)\n    " + "\n    ".join(lines))
    assert full > len(prompts) // 2, f"{pair.name}: only {full}/{len(prompts)} prompts compared over the full length"
