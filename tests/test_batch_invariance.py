"""Batch invariance, bitwise: a token's result does not depend on what shares its forward.

Per op (linear, attention, norm, logits) at row counts 1-16, 64 and 512 and at every row offset,
then the whole model over ragged batches, chunk splits and decode, in each precision.
"""
from __future__ import annotations

import pytest
import torch
from conftest import cpu_precision, on_device

from specdec.core.outputs import ScheduledChunk, SchedulerOutput
from specdec.models import rope
from specdec.models.llama import LlamaModel, apply_rope, rms_norm
from specdec.models.loader import load_model
from specdec.quant import kernel, kv_format
from specdec.quant.attention import AttentionMetadata, SeqAttention, paged_attention
from specdec.quant.layers import ROW_ALIGN, linear, pad_rows, row_align
from specdec.quant.options import KernelOptions
from specdec.runner.model_runner import ModelRunner

ROW_COUNTS = list(range(1, 17)) + [64, 512]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=["kernel", "mkl"])
def float32_options(request) -> KernelOptions:
    """float32 runs specdec's kernel where it builds, MKL in 4/8-row blocks elsewhere: check both."""
    if on_device() != "cpu":  # neither applies: one path, the GPU's (blocks of CUDA_ROW_BLOCK rows)
        if request.param == "mkl":
            pytest.skip("a CPU path")
    elif request.param == "mkl":
        return KernelOptions(dense=False)
    elif not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    return KernelOptions()


def padded(x: torch.Tensor, align: int = ROW_ALIGN) -> torch.Tensor:
    rows = pad_rows(x.shape[0], align)
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if rows > x.shape[0] else x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(8960, 1536), (1536, 8960), (1152, 896), (151936 // 8, 896)])
def test_linear_is_row_invariant(out_features, in_features, dtype, float32_options):
    if dtype != torch.float32 and not float32_options.dense:
        pytest.skip("the float32 path does not apply")
    dev = on_device()
    # 1: the kernel takes any row count
    align = row_align(str(dtype).removeprefix("torch."), dev, float32_options)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dev, dtype)
    x = torch.randn(520, in_features, generator=g).to(dev, dtype)

    def lin(rows: torch.Tensor) -> torch.Tensor:
        return linear(rows, w, options=float32_options)

    ref = lin(x[:512])
    for m in ROW_COUNTS:
        assert torch.equal(lin(padded(x[:m], align))[:m], ref[:m]), f"{m} rows"
    # the same row at every offset inside a row block
    for offset in range(1, 9):
        y = lin(padded(x[512 - offset:512 + 5], align))
        assert torch.equal(y[offset:offset + 5], lin(padded(x[512:517], align))[:5]), f"offset {offset}"


def _kernel_rms_norm(x, w, eps):
    return kernel.rms_norm(x.clone(), w, eps)


@pytest.mark.parametrize("norm,dtype", [(rms_norm, torch.float32), (rms_norm, torch.bfloat16),
                                        (_kernel_rms_norm, torch.float32)])
def test_rms_norm_is_row_invariant(norm, dtype):
    if norm is _kernel_rms_norm and (on_device() != "cpu" or not kernel.available()):
        pytest.skip("a CPU kernel" if on_device() != "cpu" else f"kernel unavailable: {kernel.unavailable_reason()}")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1536, generator=g).to(on_device(), dtype)
    w = torch.rand(1536, generator=g).to(on_device(), dtype)
    ref = norm(x, w, 1e-6)
    for m in ROW_COUNTS:
        assert torch.equal(norm(x[:m], w, 1e-6), ref[:m])
        assert torch.equal(norm(x[512 - m:], w, 1e-6), ref[512 - m:])


def test_layer_kernels_agree_with_pytorch():
    """RMSNorm (with its residual add), SwiGLU's activation, RoPE and attention in C++ against the
    PyTorch ops: RoPE bitwise, the others to float32 rounding."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    g = torch.Generator().manual_seed(5)
    h, delta, w = torch.randn(9, 896, generator=g), torch.randn(9, 896, generator=g), torch.rand(896, generator=g)
    x = h.clone()
    got = kernel.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(x, h + delta)  # the residual add, in place
    torch.testing.assert_close(got, rms_norm(h + delta, w, 1e-6), rtol=1e-6, atol=1e-6)

    gate_up = torch.randn(5, 2 * 4864, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernel.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert torch.equal(kernel.silu_mul(gate_up[2:3]), kernel.silu_mul(gate_up)[2:3])

    cos, sin = rope.rope_tables(64, 10000.0, rope.RopeScaling("yarn", 4.0, original_context=64), 300,
                                torch.device("cpu"))  # scaled cos/sin too: the kernel only looks them up
    qkv = torch.randn(6, (14 + 2 * 2) * 64, generator=g)
    positions = torch.tensor([0, 1, 17, 299, 5, 5])
    want = apply_rope(qkv[:, :16 * 64].reshape(6, 16, 64), cos[positions], sin[positions])
    kernel.rope_(qkv[:, :16 * 64].view(6, 16, 64), positions, cos, sin)  # in place on a column slice
    assert torch.equal(qkv[:, :16 * 64].reshape(6, 16, 64), want)

    heads, kv_heads, d, n = 14, 2, 64, 50
    q, k, v = (torch.randn(n, hh, d, generator=g) * 3 for hh in (heads, kv_heads, kv_heads))
    slots = torch.randperm(200, generator=g)[:n]
    outs = []
    for use in (True, False):
        outs.append(_attention(q, k, v, (torch.zeros(kv_heads, 200, d), torch.zeros(kv_heads, 200, d)),
                               [(list(range(n)), 0, slots)], kv_heads, KernelOptions(layer_ops=use)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)

    # float16 and int8 caches are read as their values (kv_format.decode): the same bits as float32 caches
    # holding those values
    ctx = kernel_contexts(n, slots)
    for dtype in (torch.float16, torch.int8):
        held = tuple(kv_format.encode(torch.randn(kv_heads, 200, d, generator=g) * 3, dtype) for _ in range(2))
        got, want = (torch.empty(n, heads * d) for _ in range(2))
        kernel.attention(q, *held, *ctx, d ** -0.5, got)
        kernel.attention(q, *(kv_format.decode(c, torch.float32, d) for c in held), *ctx, d ** -0.5, want)
        assert torch.equal(got, want)


def kernel_contexts(n: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence of n rows over `slots`, causal: the attention kernel's (ctx_slots, ctx_start, ctx_len)."""
    return slots.to(torch.int64).contiguous(), torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1)


def _attention(q, k, v, caches, seqs_spec, num_kv_heads, options=KernelOptions()):
    """seqs_spec: list of (token rows in q, start_position, slots of the whole context)."""
    rows, seqs, slot_map = [], [], []
    for idx, start, ctx_slots in seqs_spec:
        seqs.append(SeqAttention(len(rows), len(idx), start, ctx_slots))
        slot_map += ctx_slots[start:].tolist()
        rows += idx
    n = pad_rows(len(rows))
    sel = torch.tensor(rows + [rows[0]] * (n - len(rows)), device=q.device)
    meta = AttentionMetadata(torch.tensor(slot_map, device=q.device), seqs, n)
    return paged_attention(q[sel], k[sel], v[sel], caches, meta, options)[: len(rows)]


@pytest.mark.parametrize("dtype,kernels,kv_dtype", [
    (torch.float32, True, None), (torch.float32, False, None), (torch.bfloat16, False, None),
    (torch.float32, True, torch.float16), (torch.float32, False, torch.float16), (torch.float32, True, torch.int8),
    (torch.float32, False, torch.int8)])
def test_attention_same_for_prefill_chunks_decode_and_batch(dtype, kernels, kv_dtype):
    dev = on_device()
    if kernels and dev != "cpu":
        pytest.skip("a CPU kernel")
    options = KernelOptions(layer_ops=kernels)
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, length = 12, 2, 128, 70
    q = torch.randn(length, heads, d, generator=g).to(dev, dtype)
    k = torch.randn(length, kv_heads, d, generator=g).to(dev, dtype)
    v = torch.randn(length, kv_heads, d, generator=g).to(dev, dtype)
    slots = torch.randperm(256, generator=g)[:length].to(dev)  # scattered, like real block tables

    def fresh():
        cache = kv_dtype or dtype
        return tuple(torch.zeros(kv_heads, 256 + 64, kv_format.row_width(cache, d), dtype=cache, device=dev)
                     for _ in range(2))

    full = _attention(q, k, v, fresh(), [(list(range(length)), 0, slots)], kv_heads, options)
    # chunked prefill at ragged splits
    caches = fresh()
    start, outs = 0, []
    for size in (1, 7, 16, 5, 41):
        seq = (list(range(start, start + size)), start, slots[:start + size])
        outs.append(_attention(q, k, v, caches, [seq], kv_heads, options))
        start += size
    assert torch.equal(torch.cat(outs), full)
    # token-by-token decode, each step batched with an unrelated sequence
    caches = fresh()
    other = torch.arange(256, 256 + 64, device=dev)
    for pos in range(length):
        out = _attention(q, k, v, caches, [(list(range(pos % 5)), 0, other[: pos % 5]),
                                           ([pos], pos, slots[:pos + 1])], kv_heads, options)
        assert torch.equal(out[-1], full[pos]), f"position {pos}"


def _runner(path, dtype_name, blocks=64, block_size=4, options=KernelOptions()):
    cpu_precision(dtype_name)
    dev = torch.device(on_device())
    loaded = load_model(str(path), dtype_name, str(dev), progress=False)
    model = LlamaModel(loaded.config, loaded.weights, 256, dev, options=options)
    return ModelRunner(model, blocks, block_size, dev)


def _logits(runner, chunks):
    return runner.execute(SchedulerOutput(chunks=chunks, num_batched_tokens=sum(len(c.token_ids) for c in chunks))).logits


@pytest.mark.parametrize("precision", ["float32", "float32-pytorch", "bfloat16", "int4"])
@pytest.mark.parametrize("arch", ["tiny_qwen", "tiny_llama", "tiny_qwen3", "tiny_smollm3", "tiny_olmo2"])
def test_model_logits_bitwise_across_batching(arch, precision, request):
    if precision == "float32-pytorch" and on_device() != "cpu":
        pytest.skip("a CPU path")
    options = KernelOptions()
    if precision == "float32-pytorch":  # as where the C++ kernels do not build: MKL in row blocks, PyTorch ops
        options = KernelOptions(dense=False, layer_ops=False)
        precision = "float32"
    runner = _runner(request.getfixturevalue(arch), precision, options=options)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 260, (37,), generator=g).tolist()
    table = list(range(10))  # 10 blocks x 4 slots
    ref = _logits(runner, [ScheduledChunk("a", tokens, 0, table, len(tokens))])

    # chunked prefill, then decode one token at a time, with other requests in the batch
    other_table = list(range(20, 40))
    other = torch.randint(0, 260, (60,), generator=g).tolist()
    got, start, o = [], 0, 0
    for size in (3, 1, 12, 8, 1, 1, 1, 5, 1, 4):
        chunks = [ScheduledChunk("b", other[o:o + size + 1], o, other_table, 1),
                  ScheduledChunk("a", tokens[start:start + size], start, table, size)]
        got.append(_logits(runner, chunks)[1:])
        start, o = start + size, o + size + 1
    assert start == len(tokens)
    assert torch.equal(torch.cat(got), ref)


@pytest.mark.parametrize("arch,precision,skip,kv", [
    ("tiny_qwen", "float32", (), None), ("tiny_qwen", "int4", (), None), ("tiny_llama", "int4", (), None),
    ("tiny_qwen3", "float32", (), None), ("tiny_qwen3", "int4-a8", (), None), ("tiny_smollm3", "int4-a8", (), None),
    ("tiny_olmo2", "float32", (), None), ("tiny_olmo2", "int4-a8", (), None), ("tiny_olmo2", "int4-a8", (1,), None),
    ("tiny_kquant", "int4", (), None), ("tiny_kquant", "int4-a8", (), None), ("tiny_kquant", "int4-a16", (), None),
    ("tiny_qwen", "int4-a8", (), None), ("tiny_qwen", "int4", (1,), None), ("tiny_qwen", "int4-a8", (), torch.float16),
    ("tiny_qwen", "float32", (), torch.float16), ("tiny_qwen", "int4-a8", (), torch.int8)])
def test_fused_decoder_matches_the_python_loop(arch, precision, skip, kv, request):
    """The layer loop in one C++ call (quant/decoder.py) gives bitwise the Python loop's logits and
    K/V, over prefill chunks and decode steps batched with another request (and with layers skipped,
    as self-speculation does), with float32, float16 or int8 K/V caches (the C++ rounding is kv_format's)."""
    if not kernel.available():
        pytest.skip(f"kernel unavailable: {kernel.unavailable_reason()}")
    loaded = load_model(str(request.getfixturevalue(arch)), precision, progress=False)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 260, (30,), generator=g).tolist()
    other = torch.randint(0, 260, (40,), generator=g).tolist()
    results = []
    for fused in (True, False):
        model = LlamaModel(loaded.config, loaded.weights, 256, torch.device("cpu"), skip_layers=frozenset(skip),
                           options=KernelOptions(fused_decoder=fused))
        runner = ModelRunner(model, 64, 4, torch.device("cpu"), kv_dtype=kv)
        got, start, o = [], 0, 0
        for size in (9, 1, 5, 1, 1, 13):
            chunks = [ScheduledChunk("b", other[o:o + size + 1], o, list(range(20, 40)), 1),
                      ScheduledChunk("a", tokens[start:start + size], start, list(range(10)), size)]
            got.append(_logits(runner, chunks))
            start, o = start + size, o + size + 1
        assert (model._fused is not None) == fused
        results.append((torch.cat(got), [t.clone() for kv in runner.kv_caches for t in kv]))
    (logits_f, kv_f), (logits_p, kv_p) = results
    assert torch.equal(logits_f, logits_p)
    assert all(torch.equal(a, b) for a, b in zip(kv_f, kv_p))


def test_runner_recompute_is_bitwise(tiny_qwen):
    """Recomputing a prefix (preemption, prefix-cache miss) writes identical K/V and logits."""
    runner = _runner(tiny_qwen, "float32")
    tokens = list(range(3, 30))
    first = _logits(runner, [ScheduledChunk("a", tokens, 0, list(range(8)), len(tokens))])
    again = _logits(runner, [ScheduledChunk("a", tokens, 0, list(range(30, 38)), len(tokens))])
    assert torch.equal(first, again)
