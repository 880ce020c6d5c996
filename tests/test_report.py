"""The docs' tables are generated from results JSON: rendering writes them, a second run changes
nothing, and --check notices a table edited by hand."""
from __future__ import annotations

import shutil
from pathlib import Path

from specdec.bench import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


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
