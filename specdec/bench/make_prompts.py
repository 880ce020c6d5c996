"""Regenerate bench/prompts/code_edit.jsonl from the installed CPython standard library.

Functions of 30-80 lines are taken in a fixed order from fixed modules, each paired with a small,
checkable edit; the model is asked to return the whole edited function, so most of the answer
repeats the prompt (where prompt-lookup and draft models shine). Run: python -m specdec.bench.make_prompts
"""
from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

MODULES = ["argparse", "textwrap", "json.decoder", "json.encoder", "shutil", "tempfile", "csv", "difflib",
           "calendar", "ftplib", "gettext", "glob", "pprint", "string", "tarfile", "zipfile", "configparser"]
EDITS = [
    "Add type hints to the parameters and the return value.",
    "Rename the first parameter (other than self) to a more descriptive name everywhere it is used.",
    "Add a one-line docstring at the top, or replace the existing docstring with a one-line summary.",
    "Replace every double-quoted string literal with a single-quoted one.",
    "Add a comment above each `return` statement explaining what is returned.",
]


def functions(min_lines: int = 30, max_lines: int = 80):
    for mod_name in MODULES:
        mod = __import__(mod_name, fromlist=["_"])
        source = inspect.getsource(mod)
        tree = ast.parse(source)
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                start = node.lineno - 1 - len(node.decorator_list)
                body = "\n".join(lines[start:node.end_lineno])
                indent = len(body) - len(body.lstrip())
                yield mod_name, node.name, "\n".join(line[indent:] for line in body.splitlines())


def main(out: str = str(Path(__file__).parent / "prompts" / "code_edit.jsonl"), count: int = 24) -> None:
    rows, seen, per_module = [], set(), {}
    for mod_name, name, code in functions():
        if (mod_name, name) in seen or per_module.get(mod_name, 0) >= 2:  # spread over modules
            continue
        seen.add((mod_name, name))
        per_module[mod_name] = per_module.get(mod_name, 0) + 1
        edit = EDITS[len(rows) % len(EDITS)]
        prompt = (f"Apply this small change to the Python function below and return the whole function.\n"
                  f"Change: {edit}\n\n```python\n{code}\n```")
        rows.append({"prompt": prompt, "domain": "code_edit",
                     "source": f"CPython {sys.version.split()[0]} standard library: {mod_name}.{name}"})
        if len(rows) == count:
            break
    Path(out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")


if __name__ == "__main__":
    main()
