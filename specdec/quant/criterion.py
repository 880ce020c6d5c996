"""The precision criterion behind `precision: auto`: the fastest mode whose next-token distributions are
no further from float32's than llama.cpp's are on the same GGUF.

`specdec kld` measures each mode and llama.cpp against float32 on a shipped corpus and saves a
`Measurement` per model: $SPECDEC_HOME/precision/<model>.json, or shipped with the package for the
default models (`measured/`). A model with no measurement keeps the near-lossless default.

Margins, because both sides are estimates over about 25k tokens: a mode may have a mean KLD up to 5 %
above llama.cpp's (its standard error over a corpus that size is a few percent) and a same-top-1 rate
up to 0.2 points below (the binomial standard error at 97 % over 25k tokens is about 0.1 point)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.config import specdec_home

KLD_MARGIN = 1.05      # mode's mean KLD <= 1.05 x the anchor's
TOP1_MARGIN = 0.002    # mode's same-top-1 rate >= the anchor's - 0.2 points
SHIPPED = Path(__file__).with_name("measured")
KV_FORMATS = ("int8", "float16")  # smallest first: the K/V formats `auto` may hold a cache in (kv_format.py)


@dataclass
class ModeScore:
    mean_kld: float
    same_top1: float
    decode_tok_s: float | None = None   # batch-1 greedy decode on this machine; the speed ranking


@dataclass
class Measurement:
    model: str                      # the GGUF file's name
    file_bytes: int                 # its size: a measurement of another file with the same name is not used
    anchor: ModeScore               # llama.cpp on the same file
    modes: dict[str, ModeScore] = field(default_factory=dict)
    machine: str = ""
    first: int = 0                  # each chunk's first scored row (`specdec kld --first`)

    def meets(self, mode: str) -> bool:
        s = self.modes[mode]
        return s.mean_kld <= self.anchor.mean_kld * KLD_MARGIN and s.same_top1 >= self.anchor.same_top1 - TOP1_MARGIN

    def kv_choice(self, mode: str) -> str | None:
        """The smallest K/V cache format measured under `mode` (scored as 'MODE:kv=FORMAT') that meets the
        criterion; None: the model's own dtype."""
        return next((f for f in KV_FORMATS if f"{mode}:kv={f}" in self.modes and self.meets(f"{mode}:kv={f}")), None)

    def choose(self, candidates: tuple[str, ...]) -> str | None:
        """The fastest of `candidates` that meets the criterion (None if none was measured or meets it)."""
        ok = [m for m in candidates if m in self.modes and self.meets(m)]
        return max(ok, key=lambda m: self.modes[m].decode_tok_s or 0.0, default=None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        d = json.loads(text)
        return cls(model=d["model"], file_bytes=d["file_bytes"], anchor=ModeScore(**d["anchor"]),
                   modes={m: ModeScore(**s) for m, s in d["modes"].items()}, machine=d.get("machine", ""),
                   first=d.get("first", 0))


def saved_path(stem: str) -> Path:
    """Where `specdec kld --save` puts the measurement of the GGUF file `stem`.gguf."""
    return specdec_home() / "precision" / f"{stem}.json"


def measurement_for(stem: str, file_bytes: int) -> Measurement | None:
    """The measurement of this file: the user's own (`specdec kld --save`) first, then the shipped one."""
    for path in (saved_path(stem), SHIPPED / f"{stem}.json"):
        if path.exists():
            m = Measurement.from_json(path.read_text())
            if m.file_bytes == file_bytes:
                return m
    return None


CPU_MODES = ("int4-a8", "int4-a16", "int4", "bfloat16", "float32")  # what `auto` may pick where the kernel builds


def auto_kv_choice(identity: tuple[str, int] | None, mode: str) -> tuple[str, str] | None:
    """(K/V format, why) for a model running in `mode`, from its measurement; None: none meets the criterion
    or none was measured (the cache keeps the model's dtype)."""
    m = measurement_for(*identity) if identity else None
    fmt = m.kv_choice(mode) if m else None
    if fmt is None:
        return None
    s, a = m.modes[f"{mode}:kv={fmt}"], m.anchor
    return fmt, (f"the smallest K/V format no further from float32 than llama.cpp (float16 K/V) under {mode}: "
                 f"mean KLD {s.mean_kld:.4f} vs {a.mean_kld:.4f}, same top-1 {100 * s.same_top1:.1f} % vs "
                 f"{100 * a.same_top1:.1f} %")


def auto_choice(identity: tuple[str, int] | None) -> tuple[str, str] | None:
    """(mode, why) from the measurement of the GGUF file (name without .gguf, size), or None if it has
    none (or no mode meets the criterion)."""
    m = measurement_for(*identity) if identity else None
    mode = m.choose(CPU_MODES) if m else None
    if mode is None:
        return None
    s, a = m.modes[mode], m.anchor
    return mode, (f"the fastest mode no further from float32 than llama.cpp on `specdec kld`'s corpus, rows from "
                  f"{m.first} of each chunk: mean KLD "
                  f"{s.mean_kld:.4f} vs {a.mean_kld:.4f}, same top-1 {100 * s.same_top1:.1f} % vs "
                  f"{100 * a.same_top1:.1f} %{f' ({m.machine})' if m.machine else ''}")
