"""The CLI contract: JSON Lines on stdout, human lines on stderr, clear errors with non-zero exits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specdec.cli import main
from specdec.quant import kernel

STATS_KEYS = {"prompt_tokens", "generated_tokens", "seconds", "ttft_seconds", "tokens_per_second",
              "decode_tokens_per_second", "precision"}


def run(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


DEFAULT_PRECISION = "int4-a16" if kernel.available() else "float32"


def test_generate_json_lines_in_order(capsys, tiny_qwen, tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "hello", "domain": "x"}\n\n{"prompt": "the cat"}\n{"prompt": "a b c", "id": 3}\n')
    for batch in ([], ["--batch"]):
        code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--json", "--max-tokens", 5,
                             "--ignore-eos", "--prompts-file", pf, *batch)
        assert code == 0
        lines = [json.loads(line) for line in out.splitlines()]
        assert [x["prompt"] for x in lines] == ["hello", "the cat", "a b c"]
        for x in lines:
            assert set(x) >= {"prompt", "text", "token_ids", "finish_reason", "stats"}
            assert set(x["stats"]) >= STATS_KEYS and x["stats"]["precision"] == DEFAULT_PRECISION
            assert x["finish_reason"] == "length" and len(x["token_ids"]) == 5
        assert "tokens/s" in err
        if not batch:
            first = [x["token_ids"] for x in lines]
    assert [x["token_ids"] for x in lines] == first


def test_default_precision_is_said_and_recorded(capsys, tiny_qwen):
    """The CLI's default mode is int4-a16 where the kernel builds (said on stderr), float32 on request."""
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--json", "--max-tokens", 2, "hi")
    assert code == 0 and f"precision: {DEFAULT_PRECISION}" in err
    assert json.loads(out.splitlines()[0])["stats"]["precision"] == DEFAULT_PRECISION
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--json", "--max-tokens", 2,
                         "--precision", "float32", "hi")
    assert code == 0 and "precision:" not in err
    assert json.loads(out.splitlines()[0])["stats"]["precision"] == "float32"


def test_default_draft_precision_follows_the_default_mode(capsys, tiny_qwen, tiny_llama):
    """With the int4-a16 default a draft model runs in int4-a8 (its numbers never change the output); an
    explicit --draft-precision, an explicit --precision, or self-speculation keep theirs."""
    from specdec.cli import build_parser
    from specdec.commands.args import speculative_config
    from specdec.commands.generate import engine_config
    from specdec.precision import resolve_precision

    def draft_precision(args: list[str]) -> str | None:
        """What the engine built from these flags runs its draft in (None: the target's precision)."""
        a = build_parser().parse_args(["generate", "--model", str(tiny_qwen), *args, "hi"])
        spec = resolve_precision(engine_config(a, speculative_config(a)))[0].speculative
        return spec.draft.precision if spec is not None else None

    assert draft_precision(["--draft", str(tiny_llama)]) == ("int4-a8" if DEFAULT_PRECISION == "int4-a16" else None)
    for flags in (["--draft-precision", "float32"], ["--precision", "float32"], ["--draft", "self:skip=1-1"]):
        assert draft_precision(flags) == (flags[1] if flags[0] == "--draft-precision" else None)
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--draft", tiny_llama, "--json", "--max-tokens", 3,
                         "--spec-policy", "fixed", "hi")
    assert code == 0 and f"({'int4-a8' if DEFAULT_PRECISION == 'int4-a16' else 'the target precision'})" in err
    assert json.loads(out.splitlines()[0])["stats"]["precision"] == DEFAULT_PRECISION


def test_draft_vocabulary_and_requantization_flags(capsys, tiny_qwen, tiny_llama):
    """auto by default for both; all / none turn them off; a bad count is refused before loading."""
    from specdec.cli import build_parser
    from specdec.commands.args import speculative_config

    def draft(flags: list[str]):
        a = build_parser().parse_args(["generate", "--model", str(tiny_qwen), "--draft", str(tiny_llama), *flags, "hi"])
        d = speculative_config(a).draft
        return d.vocab_size, d.requantize

    assert draft([]) == ("auto", "auto")
    assert draft(["--draft-vocab", "all", "--draft-requantize", "none"]) == (None, None)
    assert draft(["--draft-vocab", "4096", "--draft-requantize", "q4_1"]) == (4096, "q4_1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--draft-vocab", "many", "hi"])
    assert "auto or all" in capsys.readouterr().err


def test_generate_plain_text_and_chat(capsys, tiny_qwen):
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--chat", "--max-tokens", 3, "hi")
    assert code == 0 and "tokens/s" in err and "finish=" in err


def test_compare_plain_warms_both_engines_up_first(capsys, tiny_qwen, monkeypatch):
    """--compare-plain times speculation and plain decoding after the same warm-up on each engine, so
    neither side pays the process's first forwards (the warm-up's one-token prompt caches nothing),
    then alternates which side goes first over its rounds."""
    from specdec.llm import LLM
    calls = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params=None, batch=True: (
        calls.append((self.engine.speculator is not None, len(prompts[0]), params.max_tokens)),
        real(self, prompts, params, batch))[1])
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--spec", "ngram", "--chat", "--max-tokens", 6,
                         "--compare-plain", "hi")
    assert code == 0 and "speedup" in err and "identical to plain" in err
    spec, plain = (True, calls[2][1], 6), (False, calls[2][1], 6)
    assert calls == [(True, 1, 4), (False, 1, 4), spec, plain, plain, spec, spec, plain]


@pytest.mark.parametrize("args,match", [
    (["--temperature", "-1", "x"], "temperature"),
    (["--top-p", "0", "x"], "top_p"),
    (["--max-tokens", "0", "x"], "max_tokens"),
    (["--max-model-len", "8", "a long prompt that does not fit in eight tokens at all"], "context"),
    ([], "no prompt"),
])
def test_generate_bad_input(capsys, tiny_qwen, args, match):
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, *args)
    assert code != 0 and match in err and out == "" and "Traceback" not in err


def test_prompt_and_file_together_is_an_error(capsys, tiny_qwen, tmp_path):
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"prompt": "x"}\n')
    code, _, err = run(capsys, "generate", "--model", tiny_qwen, "--prompts-file", pf, "also this")
    assert code != 0 and "not both" in err


def test_missing_and_corrupt_models(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", tmp_path / "nope.gguf", "x")
    assert code != 0 and "no such model" in err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    code, _, err = run(capsys, "generate", "--model", bad, "x")
    assert code != 0 and "GGUF" in err


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    assert code == 0 and "qwen2.5-coder-1.5b-instruct" in out and "smollm2-135m-instruct" in out


def test_entry_point_exit_code(tmp_path):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(tmp_path / "x.gguf"), "hi"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "error:" in r.stderr


def test_generate_a_session_with_suffix_and_hybrid(capsys, tiny_qwen, tiny_llama, tmp_path):
    """--prompts-file runs the prompts in order through one engine: the suffix cache carries."""
    pf = tmp_path / "session.jsonl"
    pf.write_text('{"prompt": "a b c a b c a b"}\n{"prompt": "x y z"}\n{"prompt": "a b c a b c a b"}\n')
    for extra in (["--spec", "suffix"], ["--spec", "hybrid", "--draft", tiny_llama]):
        code, out, err = run(capsys, "generate", "--model", tiny_qwen, *extra, "--max-tokens", 8, "--ignore-eos",
                             "--json", "--prompts-file", pf)
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and len(rows) == 3 and rows[0]["token_ids"] == rows[2]["token_ids"]
        assert {r["stats"]["method"] for r in rows} == {extra[1]}
    code, out, err = run(capsys, "generate", "--model", tiny_qwen, "--spec", "ngram", "--draft", tiny_llama, "x")
    assert code != 0 and "uses none" in err
