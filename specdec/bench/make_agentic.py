"""Regenerate bench/prompts/agentic.jsonl: the requests a coding agent sends in one session, built
from the installed CPython standard library.

Four kinds of request, interleaved in a fixed order (as an agent sends them, so a cache of earlier
outputs warms as it would): a small file to refactor and return whole; unit tests for the next
function of a module; facts of a module's docstring extracted into one fixed JSON schema; a tool
call in one fixed format. Outputs repeat their prompts (rewrites) and each other (test scaffolding,
JSON keys, tool-call syntax). Run: python -m specdec.bench.make_agentic
"""
from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

REWRITE_MODULES = ["colorsys", "bisect", "keyword", "fnmatch", "genericpath", "posixpath", "shlex", "quopri"]
TEST_FUNCTIONS = [("colorsys", "rgb_to_yiq"), ("colorsys", "yiq_to_rgb"), ("colorsys", "rgb_to_hls"),
                  ("colorsys", "hls_to_rgb"), ("colorsys", "rgb_to_hsv"), ("colorsys", "hsv_to_rgb"),
                  ("textwrap", "indent"), ("textwrap", "dedent")]
EXTRACT_MODULES = ["glob", "fnmatch", "shlex", "textwrap", "difflib", "heapq", "bisect", "calendar"]
REWRITES = ["Add type hints to every function and return the whole file.",
            "Rename single-letter local variables to descriptive names and return the whole file.",
            "Add a docstring to every function that has none and return the whole file.",
            "Replace %-formatting and str.format calls with f-strings and return the whole file."]
SCHEMA = ('{"module": string, "summary": string, "public_functions": [string], '
          '"mentions_unix": boolean, "mentions_windows": boolean}')
TOOLS = ('Tools:\n- read_file(path: string)\n- search_code(query: string, path: string)\n'
         '- run_tests(path: string, keyword: string)\n'
         'Reply with exactly one tool call and nothing else, in this format:\n'
         '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>')
TOOL_ASKS = ["Open the source of the standard library module `{m}`.",
             "Find where `{f}` is defined in the `{m}` module.",
             "Run the tests of `{m}` that mention `{f}`.",
             "Search `{m}` for calls to `{f}`."]


def _function(module: str, name: str) -> str:
    return inspect.getsource(getattr(__import__(module), name))


def _small_file(module: str, max_lines: int = 70) -> str:
    """The module's first top-level functions, up to max_lines: a small file to rewrite."""
    source = inspect.getsource(__import__(module))
    lines = source.splitlines()
    out: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            chunk = lines[node.lineno - 1 - len(node.decorator_list):node.end_lineno]
            if out and len(out) + len(chunk) > max_lines:
                break
            out += chunk + [""]
    return "\n".join(out).strip() + "\n"


def requests() -> list[dict]:
    out = []
    for i in range(6):
        mod = REWRITE_MODULES[i]
        out.append({"kind": "rewrite", "source": mod,
                    "prompt": f"{REWRITES[i % len(REWRITES)]}\n\n```python\n{_small_file(mod)}```"})
        mod_t, fn = TEST_FUNCTIONS[i]
        out.append({"kind": "tests", "source": f"{mod_t}.{fn}", "prompt": f"Write pytest unit tests for `{mod_t}.{fn}`. Use one test function per "
                                               f"behaviour and plain asserts.\n\n```python\n{_function(mod_t, fn)}```"})
        mod_e = EXTRACT_MODULES[i]
        doc = (__import__(mod_e).__doc__ or "").strip()
        out.append({"kind": "extract", "source": mod_e, "prompt": f"Extract the facts of this module documentation into JSON with "
                                                 f"the schema {SCHEMA}. Reply with the JSON only.\n\nModule "
                                                 f"`{mod_e}`:\n{doc}"})
        mod_c = EXTRACT_MODULES[-1 - i]
        names = [n for n in dir(__import__(mod_c)) if not n.startswith("_") and callable(getattr(__import__(mod_c), n))]
        ask = TOOL_ASKS[i % len(TOOL_ASKS)].format(m=mod_c, f=names[i % len(names)])
        out.append({"kind": "tool_call", "source": mod_c, "prompt": f"{TOOLS}\n\nTask: {ask}"})
    return [{"prompt": r["prompt"], "domain": "agentic", "kind": r["kind"],
             "source": f"CPython {sys.version_info.major}.{sys.version_info.minor} standard library: {r['source']}"}
            for r in out]


def main(out: str = str(Path(__file__).parent / "prompts" / "agentic.jsonl")) -> None:
    rows = requests()
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {out}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
