"""The docs' tables are generated from results JSON: rendering writes them, a second run changes
nothing, and --check notices a table edited by hand."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "tools"))  # the generator is a repository tool, not part of the package
import docs_report as report  # noqa: E402


def test_tables_are_generated_idempotent_and_checked(tmp_path, capsys):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    shutil.copy(RESULTS / "bench-spec-a16-zen4.json", tmp_path / "docs" / "results")
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\n<!-- generated:spec:bench-spec-a16-zen4 -->\nstale\n<!-- end generated -->\ntail\n")
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert report.main(["--root", str(tmp_path)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.endswith("<!-- end generated -->\ntail\n")
    assert "| code_edit" in text or "code_edit |" in text  # one row per prompt set of the run
    assert report.main(["--check", "--root", str(tmp_path)]) == 0
    readme.write_text(text.replace("| code_edit", "| edited", 1))
    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert not list(tmp_path.rglob(".*.tmp"))  # atomic writes leave nothing behind


def test_generator_lives_outside_the_package():
    """The installed package ships no tool that rewrites a checkout; `make docs` runs it from tools/."""
    import specdec
    assert not (Path(specdec.__file__).parent / "bench" / "report.py").exists()
    assert report.ROOT == ROOT
    assert "tools/docs_report.py" in (ROOT / "Makefile").read_text()
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "docs_report.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--root" in out and "--check" in out
