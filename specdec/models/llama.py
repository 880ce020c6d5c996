"""The Llama-style decoder (Llama, SmolLM2, Qwen2, Qwen3, OLMo 2, SmolLM3): RMSNorm, rotary embeddings,
GQA attention, SwiGLU MLP; how each family differs (QKV bias, q/k norms, where the norms sit, layers
without rope) is its `families.Family`.

Weights arrive fused under our own names (see `param_shapes`): `qkv` is q|k|v stacked, `gate_up`
is gate|up stacked. Q/K rows are in the rotate-half ("NeoX") layout for every architecture; the
GGUF loader undoes llama.cpp's interleaving where the family has it (`interleaved_qk`). Every
matrix product goes through `quant.layers.linear` / `quant.attention.paged_attention`, which keep
each token's numerics independent of what else shares the forward. With float32 activations on an
AVX2 CPU, RMSNorm (with the residual add before it), RoPE and SwiGLU's activation run in the C++
kernels (`quant/layer_ops.cpp`): as PyTorch ops their dispatch cost more than their arithmetic at one
token per forward. Which kernel paths a model takes is its `KernelOptions` (default: every one available).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from specdec.core.outputs import DraftChain
from specdec.models import rope
from specdec.models.families import FAMILIES, family
from specdec.models.rope import RopeScaling
from specdec.quant import kernel
from specdec.quant.attention import AttentionMetadata, paged_attention
from specdec.quant.decoder import FusedDecoder
from specdec.quant.layers import in_row_blocks, linear, row_align
from specdec.quant.options import KernelOptions, dense_kernel, layer_kernels
from specdec.quant.packed import QuantLinear

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    attention_bias: bool
    tie_embeddings: bool
    rope: RopeScaling = field(default_factory=RopeScaling)  # how the file scales its rotary frequencies
    no_rope_layers: tuple[int, ...] = ()  # layers that attend without rotary embeddings (SmolLM3)

    def to_dict(self) -> dict:
        return {**self.__dict__, "rope": self.rope.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """The inverse of `to_dict`; a KeyError where a field is missing (a cache written before it)."""
        return cls(**{f.name: d[f.name] for f in fields(cls)} | {"rope": RopeScaling.from_dict(d["rope"]),
                                                                  "no_rope_layers": tuple(d["no_rope_layers"])})

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by our name."""
    h, i, q_size, fam = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, family(cfg.architecture)
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        norms = ("input_norm", "post_norm") if fam.norms == "pre" else ("attn_out_norm", "mlp_out_norm")
        shapes[p + norms[0]] = shapes[p + norms[1]] = (h,)
        shapes[p + "qkv"] = (cfg.qkv_size, h)
        if cfg.attention_bias:
            shapes[p + "qkv_bias"] = (cfg.qkv_size,)
        if fam.qk_norm == "head":
            shapes[p + "q_norm"] = shapes[p + "k_norm"] = (cfg.head_dim,)
        elif fam.qk_norm == "projection":
            shapes[p + "q_norm"], shapes[p + "k_norm"] = (q_size,), (cfg.num_kv_heads * cfg.head_dim,)
        shapes[p + "o"] = (h, q_size)
        shapes[p + "gate_up"] = (2 * i, h)
        shapes[p + "down"] = (h, i)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cuda":  # a row reduction: one shape for every batch (quant/layers.py)
        return in_row_blocks(lambda rows: _rms_norm(rows, weight, eps), x)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # statistics in float32 whatever the activation dtype, like the reference implementations
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(cfg: LlamaConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position, [max_positions, head_dim], with the file's rope scaling (models/rope.py)."""
    return rope.rope_tables(cfg.head_dim, cfg.rope_theta, cfg.rope, max_positions, device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)


class LlamaModel:
    """Stateless forward over flat token rows; the KV cache lives in the runner."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 device: torch.device, skip_layers: frozenset[int] = frozenset(),
                 options: KernelOptions = KernelOptions()) -> None:
        """`skip_layers`: layers the forward leaves out (self-speculation: the target as its own draft).
        `options`: the kernel paths the forward may take (tests turn some off to check the fallbacks)."""
        missing = set(param_shapes(cfg)) - set(weights)
        if missing:
            raise ValueError(f"model weights missing: {sorted(missing)[:5]}")
        self.cfg = cfg
        self.family = family(cfg.architecture)
        self.w = weights
        self.lm_head = weights["embed"] if cfg.tie_embeddings else weights["lm_head"]
        qkv = weights["layers.0.qkv"]
        self.packed = isinstance(qkv, QuantLinear)  # weight-only quantized: float32 activations
        self.dtype = torch.float32 if self.packed else qkv.dtype
        self.options = options
        # rows are padded to a multiple of this
        self.row_align = row_align("int4" if self.packed else str(self.dtype).removeprefix("torch."), device,
                                   options)
        self.cos, self.sin = rope_tables(cfg, max_positions, device)
        self.vocab_ids: torch.Tensor | None = None  # set by restrict_vocab
        self._head_ids: torch.Tensor | None = None  # the token of each output column (draft_chain)
        self._chain_ready: bool | None = None
        self.skip_layers = skip_layers
        self.device = device
        self._fused: FusedDecoder | None = None  # built on first use (None after that: not possible)
        self._fused_tried = False

    def _fused_decoder(self) -> FusedDecoder | None:
        """The layer loop in one C++ call, where every layer runs on the kernels (see quant/decoder.py);
        the caller has checked the layer kernels (`_kernels`)."""
        if not (self.options.fused_decoder and (self.packed or dense_kernel(self.device, self.options))):
            return None
        if not self._fused_tried:
            cfg, w = self.cfg, self.w
            names = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "qkv", "o", "gate_up", "down",
                     "qkv_bias", "q_norm", "k_norm")
            layers = {n: {name: w[f"layers.{n}.{name}"] for name in names if f"layers.{n}.{name}" in w}
                      for n in range(cfg.num_layers) if n not in self.skip_layers}
            self._fused, self._fused_tried = FusedDecoder.build(cfg, layers, w["norm"], cfg.no_rope_layers), True
        return self._fused

    def _kernels(self) -> bool:
        cfg = self.cfg
        return (layer_kernels(self.dtype, self.device, self.options) and cfg.hidden_size % 8 == 0
                and cfg.head_dim % 16 == 0 and cfg.intermediate_size % 8 == 0)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None, fast: bool) -> torch.Tensor:
        """h += delta (in place: the residual stream), then RMSNorm(h)."""
        if fast:
            return kernel.rms_norm(h, weight, self.cfg.rms_norm_eps, delta)
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [num_rows] (num_rows padded to a multiple of `row_align`).
        Returns final-normed hidden states [num_rows, hidden_size]."""
        cfg, w, options = self.cfg, self.w, self.options
        fast = self._kernels()
        embed = w["embed"]
        h = embed.embed(input_ids) if isinstance(embed, QuantLinear) else embed[input_ids].to(self.dtype)
        fused = self._fused_decoder() if fast else None
        if fused is not None:
            return fused.forward(h.contiguous(), positions, meta.slot_mapping, meta.row_contexts(), self.cos, self.sin,
                                 kv_caches)
        pre = self.family.norms == "pre"
        row_rope = None if fast else (self.cos[positions], self.sin[positions])  # the kernel looks them up itself
        delta = None  # a pre-norm family's last MLP output, added to h by the next norm
        for n in range(cfg.num_layers):
            if n in self.skip_layers:
                continue
            p = f"layers.{n}."
            x = self._norm(h, w[p + "input_norm"], delta, fast) if pre else h
            y = linear(self._attention(n, x, positions, row_rope, meta, kv_caches), w[p + "o"], options=options)
            if pre:
                x = self._norm(h, w[p + "post_norm"], y, fast)
            else:
                x = self._add_normed(h, y, w[p + "attn_out_norm"], fast)
            gate_up = linear(x, w[p + "gate_up"], options=options)
            if fast:
                act = kernel.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = linear(act, w[p + "down"], options=options)
            if not pre:
                self._add_normed(h, delta, w[p + "mlp_out_norm"], fast)
                delta = None
        return self._norm(h, w["norm"], delta, fast)

    def _add_normed(self, h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, fast: bool) -> torch.Tensor:
        """h += RMSNorm(y): a sublayer's output normed before the residual add (OLMo 2). Returns h."""
        return h.add_(self._norm(y, weight, None, fast))

    def _attention(self, n: int, x: torch.Tensor, positions: torch.Tensor,
                   row_rope: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Layer n's attention over its input rows x: q|k|v, their norms and rotary embeddings where the
        family has them, the K/V write and paged attention. `row_rope`: each row's cos and sin for the
        PyTorch ops, None where the C++ kernels run. Returns [num_rows, num_heads * head_dim]."""
        cfg, w, p, fast = self.cfg, self.w, f"layers.{n}.", row_rope is None
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = linear(x, w[p + "qkv"], w.get(p + "qkv_bias"), options=self.options)
        norms = (w[p + "q_norm"], w[p + "k_norm"]) if self.family.qk_norm else None
        rotate = n not in cfg.no_rope_layers
        if fast:  # in place on q|k of each row
            if norms:
                kernel.qk_norms_(qkv, nh * d, nkv * d, *norms, cfg.rms_norm_eps)
            if rotate:
                kernel.rope_(qkv[:, :(nh + nkv) * d].view(-1, nh + nkv, d), positions, self.cos, self.sin)
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        if not fast and norms:  # over runs as long as the norm's weight: a head, or the whole projection
            q = rms_norm(q.reshape(q.shape[0], -1, norms[0].numel()), norms[0], cfg.rms_norm_eps)
            k = rms_norm(k.reshape(k.shape[0], -1, norms[1].numel()), norms[1], cfg.rms_norm_eps)
        q, k = q.reshape(-1, nh, d), k.reshape(-1, nkv, d)
        if not fast and rotate:
            q, k = apply_rope(q, *row_rope), apply_rope(k, *row_rope)
        return paged_attention(q, k, v.reshape(-1, nkv, d), kv_caches[n], meta, options=self.options)

    def chain_ready(self, own_heads: list[QuantLinear | torch.Tensor]) -> bool:
        """Whether `draft_chain` runs here, with these own-token output layers beside the model's."""
        if self._chain_ready is None:  # the model's own part, checked once
            fused = self._fused_decoder() if self._kernels() else None
            self._chain_ready = (fused is not None and self.row_align == 1
                                 and fused.chain_supported(self.w["embed"], [self.lm_head]))
        return self.options.draft_chain and self._chain_ready and FusedDecoder.chain_supported(None, own_heads)

    def draft_chain(self, chains: list[DraftChain], never: torch.Tensor, vocab: int,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], threads: list[int]
                    ) -> tuple[list[list[int]], list[torch.Tensor | None], list[float]]:
        """Drafts in one C++ call (`FusedDecoder.draft_chain`; check `chain_ready` first): each forward
        embeds, runs the layers and the output layer, and picks over the output layer's columns (uint8
        `never` marks those never sampled) and the chain's own tokens, greedy or drawn from a
        distribution `vocab` wide. Returns each chain's picks, its distributions (None: greedy) and
        each forward's seconds."""
        if self._head_ids is None:
            self._head_ids = (self.vocab_ids if self.vocab_ids is not None
                              else torch.arange(self.cfg.vocab_size)).to(torch.int64).contiguous()
        return self._fused_decoder().draft_chain(chains, self.w["embed"], self.lm_head, self._head_ids, never, vocab,
                                                 self.cos, self.sin, kv_caches, threads)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Score only these token ids from now on (a draft's sub-vocabulary); the rest get -inf."""
        head = self.lm_head
        self.lm_head = head.select_rows(ids) if isinstance(head, QuantLinear) else head[ids].contiguous()
        self.vocab_ids = ids.to(self.cos.device)
        self._head_ids = self._chain_ready = None

    def compute_logits(self, hidden: torch.Tensor, scatter: bool = True) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] (a multiple of `row_align` rows) -> float32 logits [num_rows, vocab].
        With a sub-vocabulary and `scatter` False: only its columns, [num_rows, len(vocab_ids)]."""
        logits = linear(hidden, self.lm_head, options=self.options).float()
        if self.vocab_ids is None or not scatter:
            return logits
        full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab_ids, logits)
