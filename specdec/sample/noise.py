"""Positional randomness: a request's noise is a pure function of (seed, choice, output position).

Gumbel coupling (Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant
Speculative Decoding", arXiv 2408.07978) needs the target and the draft to see the same Gumbel
vector G at each output position, however many draws came before it: a draft run, a rejected draft,
a preemption or another k must not shift it. So G is not read from a stream; it is computed from a
counter. Token i at position t gets SplitMix64's output function (Steele, Lea and Flood 2014) of
base(key, t) + (i + 1) * golden, a 64-bit bijection whose outputs pass BigCrush in counter mode.

The 53 top bits become v in (0, 1); G = -log(-log1p(-v)) in float32, which resolves the upper tail
(the one that lets a rare token win) down to v = 2^-53; only G < -2.8 is clipped, an event of
probability 7e-8 per token.
"""
from __future__ import annotations

import functools
import hashlib

import torch

from specdec.sample.sampler import first_argmax

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)   # SplitMix64's constants, as signed int64 (torch multiplies wrap)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def noise_key(seed: int, choice: int = 0) -> int:
    """The 64-bit key of choice `choice` of a request seeded `seed` (hashed: neighbouring seeds and
    choices give unrelated noise)."""
    digest = hashlib.blake2b(f"specdec-noise:{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def gumbel(key: int, position: int, vocab: int) -> torch.Tensor:
    """G [vocab] float32 for output position `position`."""
    return gumbel_table(torch.tensor([key]), torch.tensor([position]), vocab)[0]


def coupled_argmax(logits: torch.Tensor, key: int, position: int) -> int:
    """The Gumbel-max token of processed logits (temperature and filters applied; -inf is excluded)."""
    return int(first_argmax(add_gumbel_(logits.float().cpu().clone(), key, position)))


GUMBEL_MAX = 37.5  # G's largest value is at v = 2^-54: -log(-log1p(-2^-54)) = 54 ln 2 = 37.43


def gumbel_at(key: int, position: int, ids: torch.Tensor) -> torch.Tensor:
    """G at the given token ids (int64 [n]) of output position `position`: bitwise gumbel(key,
    position, vocab)[ids], the same elementwise computation on fewer elements."""
    return _from_counters(_mix(torch.tensor([key]) ^ _mix(torch.tensor([position]))), (ids + 1) * _GOLDEN)


def add_gumbel_(row: torch.Tensor, key: int, position: int) -> torch.Tensor:
    """A processed row [vocab] (float32, CPU) -> its Gumbel-max form, in place: row + G where that sum
    can be the largest, -inf elsewhere, so its first argmax is that of row + gumbel(key, position,
    vocab). Once the largest logit has its G, a value more than GUMBEL_MAX below that sum cannot win:
    only values within that range get theirs (a handful after top-p or top-k, 152k noise values
    otherwise)."""
    top = int(first_argmax(row))
    best = row[top: top + 1] + gumbel_at(key, position, torch.tensor([top]))
    if bool(torch.isnan(best) | torch.isposinf(best)):  # NaN or infinite logits: every value gets its noise
        return row.add_(gumbel(key, position, row.shape[-1]))
    ids = (row > best - GUMBEL_MAX).nonzero()[:, 0]  # -inf where G at the top is -inf: every finite value
    values = row[ids] + gumbel_at(key, position, ids)
    return row.fill_(float("-inf")).index_copy_(0, ids, values)


def gumbel_table(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab]: row r is G for key keys[r] at position positions[r] (int64 tensors [n]); the one
    computation behind every row, vectorized for simulations."""
    return _from_counters(_mix(keys ^ _mix(positions))[:, None], _counters(vocab))


def _from_counters(base: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """G from base(key, position) + (id + 1) * golden, elementwise: SplitMix64's output function, its
    top 53 bits as v in (0, 1), then -log(-log1p(-v)) in float32."""
    bits = _mix(base + counters)
    v = ((_shift(bits, 11).double() + 0.5) * 2.0 ** -53).float()
    return torch.log1p(-v).neg_().log_().neg_()


@functools.lru_cache(maxsize=4)
def _counters(vocab: int) -> torch.Tensor:
    return torch.arange(1, vocab + 1, dtype=torch.int64) * _GOLDEN


def _shift(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift(z, 30)) * _M1
    z = (z ^ _shift(z, 27)) * _M2
    return z ^ _shift(z, 31)
