"""Rotary position embeddings as one declared object: the frequencies a file asks for, and its tables.

`RopeScaling` holds what the model file says about its rotary frequencies; `rope_tables` turns it into
the cos/sin tables every forward looks up. The kinds, as llama.cpp and Transformers compute them:
- `none`: inv_freq[i] = theta^(-2i/d);
- `linear`: every frequency divided by `factor` (position interpolation);
- `llama3`: each frequency divided by its own factor (`freq_factors`: a Llama 3.1/3.2 GGUF's
  `rope_freqs.weight`, or derived from `rope_scaling` of a Hugging Face config);
- `yarn`: frequencies blended between extrapolation and interpolation by a ramp over the dimensions
  whose wavelength crosses the original context, and cos/sin scaled by `mscale`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

KINDS = ("none", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"
    factor: float = 1.0
    original_context: int = 0            # yarn: the context the model was trained at
    freq_factors: tuple[float, ...] = field(default=())  # llama3: one divisor per frequency (head_dim / 2)
    beta_fast: float = 32.0              # yarn: the ramp's ends, in rotations over the original context
    beta_slow: float = 1.0
    attn_factor: float = 1.0             # yarn: cos/sin scale before yarn's own 1 + 0.1 ln(factor)
    truncate: bool = True                # yarn: the ramp's ends rounded to whole dimensions (Transformers)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"rope scaling {self.kind!r} is not supported: specdec runs {', '.join(KINDS)}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind == "llama3" and not self.freq_factors:
            raise ValueError("llama3 rope scaling needs its per-frequency factors")
        if self.kind == "yarn" and self.original_context <= 0:
            raise ValueError("yarn rope scaling needs the original context length")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RopeScaling:
        return cls(**{**d, "freq_factors": tuple(d.get("freq_factors", ()))})

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """[head_dim / 2] float32 angular frequencies, scaled as declared."""
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            return base / self.factor
        if self.kind == "llama3":
            if len(self.freq_factors) != head_dim // 2:
                raise ValueError(f"llama3 rope factors: {len(self.freq_factors)} values for head_dim {head_dim}, "
                                 f"expected {head_dim // 2}")
            return base / torch.tensor(self.freq_factors, dtype=torch.float32)
        if self.kind == "yarn":
            low, high = self._yarn_range(head_dim, theta)
            ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
            extrapolate = 1.0 - ramp.clamp(0.0, 1.0)  # 1 for the fast dimensions: kept as trained
            return base / self.factor * (1.0 - extrapolate) + base * extrapolate
        return base

    def mscale(self) -> float:
        """What cos and sin are multiplied by (yarn's attention temperature; 1 otherwise)."""
        if self.kind != "yarn":
            return 1.0
        return self.attn_factor * (1.0 + 0.1 * math.log(self.factor) if self.factor > 1 else 1.0)

    def _yarn_range(self, head_dim: int, theta: float) -> tuple[float, float]:
        def dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
            return head_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        low, high = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)


def llama3_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_context: int) -> tuple[float, ...]:
    """Llama 3.1's per-frequency divisors from its `rope_scaling` (what llama.cpp's converter writes as
    `rope_freqs.weight`): long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    out = []
    for f in base.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < original_context / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_context / low_freq_factor:
            out.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def rope_tables(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position, [max_positions, head_dim] in the rotate-half layout: looked up, never
    recomputed per batch."""
    inv_freq = scaling.inv_freq(head_dim, theta)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    m = scaling.mscale()
    return (emb.cos() * m).to(device), (emb.sin() * m).to(device)
