"""A command that needs a package of the `bench` extra, run without it, fails at once with one line naming
the extra and exit code 2; everything else imports without it."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from specdec import cli
from specdec.extras import MissingExtraError, require, require_plotting

BENCH_MODULES = ("matplotlib", "rouge_score", "sacrebleu", "jsonschema")


def _missing(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:  # None in sys.modules makes `import name` raise ImportError
        monkeypatch.setitem(sys.modules, name, None)


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and "pip install 'specdec[bench]'" in err[0]
    return err[0]


def test_require_names_the_distribution_and_the_extra(monkeypatch):
    _missing(monkeypatch, "rouge_score")
    with pytest.raises(MissingExtraError, match=r"^specdec eval needs rouge-score: pip install 'specdec\[bench\]'$"):
        require("rouge_score", "bench", "specdec eval")
    require("json", "bench", "specdec eval")  # present: nothing happens


def test_an_empty_plot_needs_no_matplotlib(monkeypatch):
    _missing(monkeypatch, "matplotlib")
    require_plotting("", "specdec bench steps")
    require_plotting(None, "specdec bench steps")
    with pytest.raises(MissingExtraError, match=r"needs matplotlib: .*\(or --plot '' for no plot\)"):
        require_plotting("bench.png", "specdec bench steps")


def test_eval_without_the_scorers_exits_2_before_loading(monkeypatch, capsys):
    _missing(monkeypatch, "rouge_score")
    assert cli.main(["eval", "--num-prompts", "1", "--max-tokens", "4"]) == 2
    assert "specdec eval needs rouge-score" in _one_error_line(capsys)


@pytest.mark.parametrize("argv, what", [
    (["bench", "steps", "--rows", "1", "--repeats", "1"], "specdec bench steps"),
    (["kld"], "specdec kld"),
    (["profile-drafts"], "specdec profile-drafts"),
])
def test_plotting_commands_without_matplotlib_exit_2(monkeypatch, capsys, argv, what):
    _missing(monkeypatch, "matplotlib")
    assert cli.main(argv) == 2
    assert f"{what} needs matplotlib" in _one_error_line(capsys)


def test_structured_bench_needs_jsonschema_first(monkeypatch):
    from specdec.bench.structured import run_structured_bench
    _missing(monkeypatch, "jsonschema")
    with pytest.raises(MissingExtraError, match="specdec bench structured needs jsonschema"):
        run_structured_bench(argparse.Namespace(plot=""))


def test_the_cli_server_and_engine_import_without_the_bench_extra():
    blocked = ", ".join(repr(m) for m in BENCH_MODULES)
    code = (f"import sys; sys.modules.update(dict.fromkeys([{blocked}]))\n"
            "from specdec import cli, engine, llm\nfrom specdec.server import app\n"
            "cli.build_parser().parse_args(['bench', 'spec'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
