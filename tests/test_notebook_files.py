"""The chapter notebooks as saved in the repository: valid nbformat 4.5, without outputs.

The book build executes them; outputs saved in the source would go stale as the package moves,
and cells without ids make nbformat warn (and, from nbformat 6, fail) on every read.
"""

import json
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "chapters").glob("*.ipynb"))


def test_there_are_chapter_notebooks():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_valid_and_without_outputs(path):
    raw = json.loads(path.read_text())  # as saved: nbformat.read would fill in missing ids
    ids = [cell.get("id") for cell in raw["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"{path.name}: cells {missing} have no id; add one (any 8 hex digits)"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"
    nbformat.validate(nbformat.from_dict(raw))
    executed = [
        i
        for i, cell in enumerate(raw["cells"])
        if cell["cell_type"] == "code" and (cell["outputs"] or cell["execution_count"])
    ]
    assert not executed, f"{path.name}: cells {executed} were saved with outputs; clear them"
