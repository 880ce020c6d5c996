"""The decoder's layer loop as one C++ call (`decoder.cpp`): the model's weights described once as
ctypes structs (`kernels.h`, mirrored in `kernel.py`), then each forward is a single call instead of
about ten kernel calls per layer.

Used by `LlamaModel.forward` whenever every layer runs on the C++ kernels (float32 activations on an
AVX2 CPU, weights packed or dense float32); the Python loop stays for every other case and as the
reference (the results are bitwise the same: `tests/test_batch_invariance.py`)."""
from __future__ import annotations

import ctypes

import torch

from specdec.quant import kernel, kv_format
from specdec.core.outputs import DraftChain
from specdec.quant.kernel import ChainRow, Dims, Layer, Linear, Part
from specdec.quant.packed import QuantLinear, QuantTensor

_SUPPORTED = {(4, 32), (8, 32), (6, 16)}  # (bits, group) the linear kernel runs
_SUPPORTED_A8 = {(4, 64), (3, 64)}          # ... and with int8 activations only (a requantized draft's)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _float32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _cache(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and dtype in kv_format.DTYPES and t.device.type == "cpu" and t.is_contiguous()


class FusedDecoder:
    """The layers of one model as the C++ loop sees them. `build` returns None where some weight has a
    form the loop does not run (the caller keeps the Python loop)."""

    def __init__(self, cfg, layers: dict[int, dict[str, object]], final_norm: torch.Tensor,
                 no_rope: tuple[int, ...] = ()) -> None:
        """layers: the weights of each layer the forward runs, by layer number (self-speculation skips some);
        no_rope: the layers that attend without rotary embeddings."""
        self._keep: list[object] = []  # the ctypes arrays the structs point into
        self.indices = sorted(layers)
        self.layers = (Layer * len(layers))()
        for slot, n in zip(self.layers, self.indices):
            w = layers[n]
            slot.input_norm, slot.post_norm = _ptr(w.get("input_norm")), _ptr(w.get("post_norm"))
            slot.attn_out_norm, slot.mlp_out_norm = _ptr(w.get("attn_out_norm")), _ptr(w.get("mlp_out_norm"))
            slot.q_norm, slot.k_norm = _ptr(w.get("q_norm")), _ptr(w.get("k_norm"))
            slot.rope = int(n not in no_rope)
            slot.qkv = self._linear(w["qkv"], w.get("qkv_bias"))
            slot.o, slot.gate_up, slot.down = self._linear(w["o"]), self._linear(w["gate_up"]), self._linear(w["down"])
        self.dims = Dims(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, num_heads=cfg.num_heads,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                         attn_scale=cfg.head_dim ** -0.5)
        first = layers[self.indices[0]] if self.indices else {}
        if "q_norm" in first:
            self.dims.q_norm_len, self.dims.k_norm_len = first["q_norm"].numel(), first["k_norm"].numel()
        self.final_norm = final_norm
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def build(cls, cfg, layers: dict[int, dict[str, object]], final_norm: torch.Tensor,
              no_rope: tuple[int, ...] = ()) -> FusedDecoder | None:
        vectors = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "qkv_bias", "q_norm", "k_norm")
        tensors = [final_norm] + [w[name] for w in layers.values() for name in vectors if name in w]
        if not all(_float32(t) for t in tensors):
            return None
        for w in layers.values():
            for name in ("qkv", "o", "gate_up", "down"):
                if not _supported(w[name]):
                    return None
        return cls(cfg, layers, final_norm, no_rope)

    def _linear(self, weight: QuantLinear | torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return describe_linear(weight, bias, self._keep)

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the layers at the runner's caches (allocated once: bound on the first call)."""
        if self._caches is not kv_caches:
            dtype = kv_caches[0][0].dtype
            if not all(_cache(k, dtype) and _cache(v, dtype) for k, v in kv_caches):
                raise ValueError("the fused decoder needs contiguous CPU K/V caches, all of one kv_format dtype")
            for slot, n in zip(self.layers, self.indices):
                slot.k_cache, slot.v_cache = kv_caches[n][0].data_ptr(), kv_caches[n][1].data_ptr()
            self.dims.kv_format = kv_format.CODES[dtype]
            self.dims.kv_slots = kv_caches[0][0].shape[1]
            if any(c.shape != kv_caches[0][0].shape for kv in kv_caches for c in kv):
                raise ValueError("the fused decoder needs every layer's K/V caches of one shape")
            self._caches = kv_caches

    def forward(self, h: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                row_contexts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """h: [rows, hidden] float32 embeddings (the residual stream, updated in place) -> final-normed
        hidden states [rows, hidden]. Writes each real row's K/V into its slot of `kv_caches` (one (k, v)
        per layer of the model, skipped ones included)."""
        self._bind(kv_caches)
        assert h.dtype == torch.float32 and h.is_contiguous() and positions.dtype == slot_mapping.dtype == torch.int64
        out = torch.empty_like(h)
        ctx_slots, ctx_start, ctx_len = row_contexts
        assert ctx_len.shape[0] == h.shape[0], "one context per row (the C++ loop reads them unchecked)"
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        rc = kernel._lib().decoder_forward(
            self.layers, len(self.indices), ctypes.byref(self.dims), self.final_norm.data_ptr(), h.data_ptr(),
            h.shape[0], positions.data_ptr(), slot_mapping.data_ptr(),
            slot_mapping.shape[0], ctx_slots.data_ptr(), ctx_start.data_ptr(), ctx_len.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError("decoder_forward: a linear layer's layout is not supported by the kernel")
        return out

    @staticmethod
    def chain_supported(embed: QuantLinear | torch.Tensor | None, heads: list[QuantLinear | torch.Tensor]) -> bool:
        """Whether `draft_chain` runs with this embedding table (None: not checked) and these output layers."""
        return (embed is None or _embedding(embed, []) is not None) and all(_supported(h) for h in heads)

    def draft_chain(self, chains: list[DraftChain], embed: QuantLinear | torch.Tensor, head: QuantLinear | torch.Tensor,
                    head_ids: torch.Tensor, never: torch.Tensor, vocab: int, cos: torch.Tensor, sin: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], threads: list[int]
                    ) -> tuple[list[list[int]], list[torch.Tensor | None], list[float]]:
        """Each chain's drafts, all in one C++ call (decoder.cpp's draft_chain): forward s runs the
        chains with more than s steps through the layer loop (the first feeding each chain's `feed`,
        every later one its last pick), scores each chain's last row with `head` (int64 `head_ids` its
        columns' tokens, uint8 `never` its never-sample columns) and the chain's own tokens' rows,
        and picks (draft_pick.h). `vocab`: the width of a sampled chain's distributions. `threads`:
        each forward's thread count. Returns each chain's `steps` picks, its distributions ([steps,
        vocab], None for a greedy chain) and each forward's seconds."""
        self._bind(kv_caches)
        keep: list[object] = []
        table = _embedding(embed, keep)
        if table is None or head_ids.dtype != torch.int64 or never.dtype != torch.uint8:
            raise ValueError("draft_chain: unsupported embedding table or column arrays")
        rows = (ChainRow * len(chains))()
        tokens, probs = [], []
        for row, c in zip(rows, chains):
            slots = c.slots.to(torch.int64).contiguous()
            if not c.feed or c.steps < 1 or slots.shape[0] < c.position + len(c.feed) + c.steps - 1:
                raise ValueError("draft_chain: a chain needs tokens to feed, a step, and a slot for each position")
            tokens.append(torch.tensor(c.feed + [0] * c.steps, dtype=torch.int64))
            keep.append(slots)
            row.feed, row.steps, row.position = len(c.feed), c.steps, c.position
            row.slots, row.tokens = slots.data_ptr(), tokens[-1].data_ptr()
            own = 0
            if c.own_head is not None:
                row.own = describe_linear(c.own_head, None, keep)
                keep.append(ids := c.own_ids.to(torch.int64).contiguous())
                row.own_ids, own = ids.data_ptr(), row.own.n
            probs.append(self._sampled(row, c, vocab, keep) if c.temperature > 0 else None)
        steps = max(c.steps for c in chains)
        seconds = (ctypes.c_double * steps)()
        rc = kernel._lib().draft_chain(
            self.layers, len(self.indices), ctypes.byref(self.dims), self.final_norm.data_ptr(), ctypes.byref(table),
            ctypes.byref(describe_linear(head, None, keep)), head_ids.data_ptr(), never.data_ptr(), rows, len(chains),
            cos.data_ptr(), sin.data_ptr(), (ctypes.c_int * steps)(*threads), seconds)
        if rc != 0:
            raise RuntimeError("draft_chain: a layout is not supported by the kernel")
        return [t[len(c.feed):].tolist() for t, c in zip(tokens, chains)], probs, list(seconds)

    @staticmethod
    def _sampled(row: ChainRow, c: DraftChain, vocab: int, keep: list) -> torch.Tensor | None:
        """A sampled chain's parameters into its row: its noise key (coupled) or its uniform draws;
        returns the zeroed distributions a drawn chain fills."""
        row.temperature, row.top_k, row.top_p, row.min_p, row.vocab = c.temperature, c.top_k, c.top_p, c.min_p, vocab
        if (c.uniform is None) == (c.noise_key is None):
            raise ValueError("draft_chain: a sampled chain is coupled (a noise key) or drawn (uniform draws)")
        if c.noise_key is not None:
            row.noise_key, row.noise_at = c.noise_key, c.noise_at
            return None
        uniform = c.uniform.to(torch.float64).contiguous()
        if tuple(uniform.shape) != (c.steps,):
            raise ValueError(f"draft_chain: a drawn chain needs {c.steps} uniform draws")
        probs = torch.zeros(c.steps, vocab)
        keep += [uniform, probs]
        row.uniform, row.probs = uniform.data_ptr(), probs.data_ptr()
        return probs


def describe_linear(weight: QuantLinear | torch.Tensor, bias: torch.Tensor | None, keep: list) -> Linear:
    """A linear layer as `kernels.h`'s struct: its parts side by side. The Part array goes into `keep`,
    which must outlive every call that reads it."""
    parts = _parts(weight)
    act = weight.act if isinstance(weight, QuantLinear) else 0
    arr = (Part * len(parts))()
    for slot, (p, sub, mins, tiles) in zip(arr, parts):
        if isinstance(p, QuantTensor):
            slot.n, slot.bits, slot.group, slot.act = p.rows, p.bits, p.group, p.act_of(act)
            slot.codes, slot.scale, slot.offset = p.codes.data_ptr(), p.scale.data_ptr(), _ptr(p.offset)
            if sub is not None:
                slot.sub, slot.dsup = sub.data_ptr(), p.super_scale.data_ptr()
            if mins is not None:
                slot.mins, slot.dmin = mins.data_ptr(), p.super_min.data_ptr()
            if tiles is not None:
                slot.tiles = tiles.data_ptr()
        else:
            slot.n, slot.dense = p.shape[0], p.data_ptr()
    keep.append(arr)
    n = sum(slot.n for slot in arr)
    return Linear(ctypes.cast(arr, ctypes.POINTER(Part)), len(parts), n, _ptr(bias))


def _embedding(embed: QuantLinear | torch.Tensor, keep: list) -> Part | None:
    """An embedding table as the Part `draft_chain` reads rows of (float32 rows, or one part of 8-bit
    codes, or 4-bit codes in 32-value chunks), kept alive in `keep`; None for any other form."""
    part = Part()
    if isinstance(embed, torch.Tensor):
        if not _float32(embed) or embed.dim() != 2:
            return None
        part.n, part.dense = embed.shape[0], embed.data_ptr()
    else:
        p = embed.parts[0] if len(embed.parts) == 1 else None
        if not isinstance(p, QuantTensor) or not (p.bits == 8 or (p.bits == 4 and p.cols % 32 == 0)):
            return None
        part.n, part.bits, part.group = p.rows, p.bits, p.group
        part.codes, part.scale, part.offset = p.codes.data_ptr(), p.scale.data_ptr(), _ptr(p.offset)
        keep.append(p)
    keep.append(embed)
    return part


def _supported(weight: object) -> bool:
    """Whether the C++ loop runs this linear layer as `layers.linear` would: packed parts in a
    layout `qlinear` takes (super-block scales exist only for its two super-block layouts, see
    `QuantTensor.super_blocks`), dense float32 parts through `dense_linear` (k a multiple of 8)."""
    if not isinstance(weight, (QuantLinear, torch.Tensor)):
        return False
    act = weight.act if isinstance(weight, QuantLinear) else 0
    for p, sub, _, _ in _parts(weight):
        if isinstance(p, QuantTensor):
            layouts = _SUPPORTED | _SUPPORTED_A8 if p.act_of(act) == 8 else _SUPPORTED
            if (p.bits, p.group) not in layouts or p.cols % p.group or (sub is not None and p.cols % 256):
                return False
        elif not (_float32(p) and p.shape[1] % 8 == 0):
            return False
    return True


def _parts(weight: QuantLinear | torch.Tensor) -> list[tuple[QuantTensor | torch.Tensor, torch.Tensor | None,
                                                            torch.Tensor | None, torch.Tensor | None]]:
    """A linear layer's parts, each with its integer group scales, minimums and row-interleaved tiles
    (None where it has none)."""
    if isinstance(weight, QuantLinear):
        return list(zip(weight.parts, weight.subs, weight.mins, weight.tiles))
    return [(weight, None, None, None)]
