"""The grant table of docs/security.md is what the server is given: `python -m workers.launch.grant_table` writes
it from `relax_bus.ops.auth.permissions`, and `--check` fails when the committed table differs from the code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from workers.launch import grant_table

pytestmark = pytest.mark.unit


def copy_of_the_doc(root: Path) -> Path:
    """docs/security.md under `root`, for `grant_table.main` to read and write there instead."""
    doc = root / grant_table.DOC
    doc.parent.mkdir(parents=True)
    shutil.copy(grant_table.ROOT / grant_table.DOC, doc)
    return doc


def test_the_committed_table_is_what_the_code_grants() -> None:
    assert grant_table.main(["--check"]) == 0, "run `python -m workers.launch.grant_table`"


def test_a_tampered_table_is_detected_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = copy_of_the_doc(tmp_path)
    honest = doc.read_text()
    # A grant the code does not give: the rollout user creating consumers (findings 1-3 of the re-audit).
    row = next(line for line in honest.splitlines() if line.startswith("| `<run>-rollout` |"))
    forged = row.replace("the above, and ", "the above, and `$JS.API.CONSUMER.CREATE.>`<br>", 1)
    doc.write_text(honest.replace(row, forged))
    monkeypatch.setattr(grant_table, "ROOT", tmp_path)

    assert grant_table.main(["--check"]) == 1
    assert "grant table differs from the code" in capsys.readouterr().err
    assert "CONSUMER.CREATE" in doc.read_text(), "--check writes nothing"

    assert grant_table.main([]) == 0
    assert doc.read_text() == honest
    assert grant_table.main(["--check"]) == 0


def test_text_outside_the_markers_is_kept_and_a_doc_without_them_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = copy_of_the_doc(tmp_path)
    monkeypatch.setattr(grant_table, "ROOT", tmp_path)
    doc.write_text(doc.read_text().replace("## Threat model", "## Threat model, edited by hand"))
    assert grant_table.main(["--check"]) == 0

    doc.write_text(doc.read_text().replace(grant_table.BEGIN, ""))
    with pytest.raises(SystemExit, match=r"markers .* are missing"):
        grant_table.main(["--check"])
