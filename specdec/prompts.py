"""The shipped prompt sets and the JSONL prompt-file format, shared by the CLI, the benchmarks and the
quality tools.

A prompt file holds one JSON object per line with a string "prompt" (other keys are ignored; blank
lines are skipped). The sets live in specdec/bench/prompts/<set>.jsonl. This module imports nothing
from specdec, so every tool above the engine can use it without depending on another tool.
"""
from __future__ import annotations

import json
from pathlib import Path

PROMPTS_DIR = Path(__file__).resolve().parent / "bench" / "prompts"
SETS = ("code_edit", "code_gen", "chat", "prose", "zh", "agentic")  # every shipped set, in report order


def read_prompts_file(path: str) -> list[str]:
    """The prompts of a JSONL file, in order.

    Raises:
        ValueError: a line that is not JSON or has no string "prompt", an empty prompt, or a file
            without prompts (OSError: a file that cannot be read).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f'{path}:{n}: expected an object with a string "prompt"')
        if not obj["prompt"]:
            raise ValueError(f"{path}:{n}: the prompt is empty")
        prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def set_path(name: str) -> Path:
    """The file of a shipped prompt set."""
    return PROMPTS_DIR / f"{name}.jsonl"


def read_set(name: str) -> list[str]:
    """The prompts of a shipped set (see SETS)."""
    return read_prompts_file(str(set_path(name)))


def available_sets() -> list[str]:
    """The sets present on disk, sorted."""
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))
