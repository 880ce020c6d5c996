"""`specdec cache` on a fake $SPECDEC_HOME: the listing by model and kind, selective clearing, the errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import cli
from specdec.catalog import REGISTRY
from specdec.commands import cache

QWEN = "qwen2.5-coder-0.5b-instruct"
QWEN_SHA = REGISTRY[QWEN].sha256
MINE_SHA = "ab" * 32       # a GGUF of the user's own, known through sha256.json
UNKNOWN_SHA = "cd" * 32    # a cache whose GGUF nobody remembers


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    if cache not in cli.SUBCOMMANDS:  # until cli.py lists the command
        monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, cache))
    _write(home / "models" / f"{QWEN}.gguf", 1000)
    _write(home / "models" / "mine.gguf", 500)
    _write(home / "models" / ".mine.gguf.77.partial", 8)  # an interrupted `models pull`
    for name, size in [("weights-float32.safetensors", 4000), ("weights-int4.safetensors", 700),
                       ("tokenizer.json", 30), ("tokenizer_meta.json", 20), ("config.json", 3)]:
        _write(home / "cache" / QWEN_SHA / name, size)
    _write(home / "cache" / MINE_SHA / "weights-bfloat16.safetensors", 2000)
    _write(home / "cache" / MINE_SHA / ".weights-int4.safetensors.123.tmp", 7)
    _write(home / "cache" / UNKNOWN_SHA / "weights-int4.safetensors", 300)
    _write(home / "kernels" / "qlinear-0123.so", 50)
    _write(home / "peers" / "llama-cpp" / "lib" / "llama.so", 60)
    _write(home / "precision" / f"{QWEN}.json", 5)
    _write(home / "subvocab" / "key.json", 4)
    _write(home / "stray.txt", 2)
    memo = {f"{(home / 'models' / f'{QWEN}.gguf').resolve()}|1000|1": QWEN_SHA,
            f"{(home / 'models' / 'mine.gguf').resolve()}|500|2": MINE_SHA,
            "/elsewhere/other.gguf|9|3": "ef" * 32}
    (home / "sha256.json").write_text(json.dumps(memo))
    return home


def _total(home: Path) -> int:
    return sum(p.stat().st_size for p in home.rglob("*") if p.is_file())


def _files(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()}


def test_list_by_model_and_kind_with_a_total(home, capsys):
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr().out == out
    owners = [line.split()[0] for line in out.splitlines() if not line.startswith((" ", "total"))]
    # models first (by name; an unknown cache by its short hash), then the rest of the home
    assert owners == [UNKNOWN_SHA[:12], "mine", QWEN, "kernels", "llama-cpp", QWEN, "sha256.json", "stray.txt",
                      "subvocab"]
    rows = {(owner, line.split()[0]) for owner, line in _rows(out)}
    assert {(QWEN, "gguf"), (QWEN, "float32"), (QWEN, "int4"), (QWEN, "tokenizer"), (QWEN, "config"),
            ("mine", "gguf"), ("mine", "bfloat16"), ("mine", "partial"), (UNKNOWN_SHA[:12], "int4"),
            (QWEN, "precision"), ("llama-cpp", "peers"), ("kernels", "kernels"), ("stray.txt", "other"),
            ("sha256.json", "index")} <= rows
    assert f"total {cache.human(_total(home))} in {home}" in out


def _rows(out: str) -> list[tuple[str, str]]:
    owner, rows = "", []
    for line in out.splitlines():
        if line.startswith("  "):
            rows.append((owner, line.strip()))
        elif not line.startswith("total"):
            owner = line.split()[0]
    return rows


def test_clear_one_kind_across_models(home, capsys):
    before = _total(home)
    assert cli.main(["cache", "clear", "--kind", "int4"]) == 0
    out = capsys.readouterr().out
    assert f"removed {QWEN} int4" in out and f"removed {UNKNOWN_SHA[:12]} int4" in out
    assert f"freed {cache.human(1000)}" in out
    assert not (home / "cache" / QWEN_SHA / "weights-int4.safetensors").exists()
    assert not (home / "cache" / UNKNOWN_SHA).exists()  # emptied: the folder goes too
    assert (home / "cache" / QWEN_SHA / "weights-float32.safetensors").exists()
    assert (home / "cache" / MINE_SHA / ".weights-int4.safetensors.123.tmp").exists()
    assert _total(home) == before - 1000


def test_clear_a_model_drops_its_files_and_its_sha256_entry(home, capsys):
    memo_before = json.loads((home / "sha256.json").read_text())
    assert cli.main(["cache", "clear", "--model", QWEN]) == 0
    assert not (home / "models" / f"{QWEN}.gguf").exists()
    assert not (home / "cache" / QWEN_SHA).exists()
    assert (home / "precision" / f"{QWEN}.json").exists()  # a measurement: only with --kind precision
    memo = json.loads((home / "sha256.json").read_text())
    assert memo == {k: v for k, v in memo_before.items() if v != QWEN_SHA}
    assert not list(home.glob(".sha256.json*"))  # the temporary name was renamed away
    assert "freed" in capsys.readouterr().out


def test_clear_a_model_and_kind_together(home):
    assert cli.main(["cache", "clear", "--model", "mine", "--kind", "gguf"]) == 0
    assert not (home / "models" / "mine.gguf").exists()
    assert (home / "cache" / MINE_SHA / "weights-bfloat16.safetensors").exists()
    assert MINE_SHA not in json.loads((home / "sha256.json").read_text()).values()
    assert cli.main(["cache", "clear", "--model", UNKNOWN_SHA[:12]]) == 0
    assert not (home / "cache" / UNKNOWN_SHA).exists()
    assert (home / "models" / ".mine.gguf.77.partial").exists()
    assert cli.main(["cache", "clear", "--model", "mine"]) == 0  # alone: every file still known as "mine"
    assert not (home / "models" / ".mine.gguf.77.partial").exists()
    # with its GGUF and memo entry gone, nothing names the cache any more: it goes by its short hash
    assert (home / "cache" / MINE_SHA).exists()
    assert cli.main(["cache", "clear", "--model", MINE_SHA[:12]]) == 0
    assert not (home / "cache" / MINE_SHA).exists()


def test_dry_run_removes_nothing(home, capsys):
    files = _files(home)
    assert cli.main(["cache", "clear", "--all", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would free {cache.human(_total(home))}" in out
    assert _files(home) == files


def test_clear_all_empties_the_home(home):
    assert cli.main(["cache", "clear", "--all"]) == 0
    assert _files(home) == set()  # the empty top folders stay: writers expect them or make them
    assert cli.main(["cache", "clear", "--all"]) == 0  # nothing left: nothing to do


@pytest.mark.parametrize("argv, message", [
    (["cache", "clear"], "error: name what to clear"),
    (["cache", "clear", "--all", "--kind", "int4"], "error: --all clears everything"),
    (["cache", "clear", "--model", "nosuch"], "error: nothing cached for nosuch"),
])
def test_errors_are_one_line_and_exit_2(home, capsys, argv, message):
    files = _files(home)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert _files(home) == files


def test_an_unknown_kind_is_refused_by_the_parser(home):
    with pytest.raises(SystemExit) as e:
        cli.main(["cache", "clear", "--kind", "weights"])
    assert e.value.code == 2


def test_an_empty_home_lists_a_zero_total(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "nothing"))
    if cache not in cli.SUBCOMMANDS:
        monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, cache))
    assert cli.main(["cache"]) == 0
    assert capsys.readouterr().out.strip() == f"total 0 B in {tmp_path / 'nothing'}"
