"""Regenerate bench/corpus/kld.jsonl, the text `specdec kld` scores, from named sources:

- code: whole modules of the installed CPython standard library, in a fixed order;
- prose: the standard library's long module docstrings and the history section of CPython's LICENSE;
- chat: the shipped chat and prose prompts in the target's chat template, each with the answer the
  float32 target gives it (greedy);
- zh: CPython's Chinese codec test texts (simplified and traditional) and the shipped Chinese prompts
  with the float32 target's answers.

Each row is {"kind", "source", "text"}; chat rows hold the rendered template, special tokens included.
Run: python -m specdec.bench.make_kld_corpus (about 10 minutes on 2 cores: the answers are generated in
one continuous batch).
"""
from __future__ import annotations

import inspect
import json
import sys
import sysconfig
from pathlib import Path

CORPUS = Path(__file__).parent / "corpus" / "kld.jsonl"
CODE_MODULES = ["textwrap", "json.decoder", "colorsys"]
PROSE_MODULES = ["doctest", "pickle", "argparse", "heapq", "bisect", "decimal", "http.cookies", "ftplib",
                 "tarfile", "logging", "unittest", "optparse", "concurrent.futures", "asyncio", "statistics",
                 "collections", "contextlib", "enum", "difflib", "inspect", "shelve", "zipfile", "uuid", "locale"]
ZH_CODEC_TEXTS = ["gb18030-utf8.txt", "big5-utf8.txt"]  # gb2312 and gbk hold the same text as gb18030
ANSWER_TOKENS = {"chat": 160, "prose": 160, "zh": 192}


def code_rows() -> list[dict]:
    rows = []
    for name in CODE_MODULES:
        mod = __import__(name, fromlist=["_"])
        rows.append({"kind": "code", "source": f"CPython {sys.version.split()[0]} Lib/{name.replace('.', '/')}.py",
                     "text": inspect.getsource(mod)})
    return rows


def prose_rows() -> list[dict]:
    rows = []
    for name in PROSE_MODULES:
        doc = inspect.getdoc(__import__(name, fromlist=["_"])) or ""
        if len(doc) >= 400:
            rows.append({"kind": "prose", "source": f"CPython Lib/{name.replace('.', '/')} docstring", "text": doc})
    license_text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    history = license_text.split("B. TERMS AND CONDITIONS")[0]
    rows.append({"kind": "prose", "source": "CPython LICENSE.txt, A. HISTORY OF THE SOFTWARE", "text": history})
    return rows


def zh_codec_rows() -> list[dict]:
    folder = Path(sysconfig.get_paths()["stdlib"]) / "test" / "cjkencodings"
    return [{"kind": "zh", "source": f"CPython Lib/test/cjkencodings/{f}",
             "text": (folder / f).read_text(encoding="utf-8")} for f in ZH_CODEC_TEXTS]


def answered_rows(model: str) -> list[dict]:
    """The shipped chat, prose and zh prompts in the chat template, answered by the float32 target."""
    from specdec.llm import LLM
    from specdec.prompts import read_set
    from specdec.sampling_params import SamplingParams

    llm = LLM(model=model, precision="float32")
    tok = llm.tokenizer
    items = [(set_name, text) for set_name in ANSWER_TOKENS for text in read_set(set_name)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for _, t in items]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    params = [SamplingParams(max_tokens=ANSWER_TOKENS[s]) for s, _ in items]
    outs = llm.generate(ids, params)
    return [{"kind": "zh" if s == "zh" else "chat", "source": f"bench/prompts/{s}.jsonl, answered by {model} float32",
             "text": p + o.text} for (s, _), p, o in zip(items, prompts, outs)]


def main(model: str = "qwen2.5-coder-1.5b-instruct") -> None:
    from specdec.fileio import atomic_write_text

    rows = code_rows() + prose_rows() + zh_codec_rows() + answered_rows(model)
    CORPUS.parent.mkdir(exist_ok=True)
    atomic_write_text(CORPUS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} documents to {CORPUS}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
