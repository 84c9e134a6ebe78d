"""What the text calls a fold is what its button says (issue 34: worked problems said "Click to
show" above a button that says "Show code cell content"). A worked problem's answer is a code cell
tagged hide-cell with the metadata {"mystnb": {"code_prompt_show": "Show the worked answer",
"code_prompt_hide": "Hide the worked answer"}}. From the sources, in milliseconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUOTED = re.compile(r'\("((?:Click|Show|Hide)[^"]*)"\)')


def folds_and_quotes(nb: dict) -> tuple[list[str], list[str]]:
    """The prompts of the folded cells of the notebook's worked problems, and the fold labels its
    markdown quotes (as `("Show ...")`, whitespace joined)."""
    prompts, quoted, inside = [], [], False
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            heads = re.findall(r"^#+ .*", source, re.M)
            inside = ("Worked problems" in heads[-1]) if heads else inside
            quoted += [" ".join(q.split()) for q in QUOTED.findall(source)]
        elif inside and "hide-cell" in cell.get("metadata", {}).get("tags", []):
            mystnb = cell["metadata"].get("mystnb", {})
            prompts.append(mystnb.get("code_prompt_show", "Show code cell {type}"))
    return prompts, quoted


def test_worked_answers_fold_under_the_label_the_text_gives():
    seen = 0
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        prompts, quoted = folds_and_quotes(json.loads(path.read_text()))
        assert set(prompts) <= {"Show the worked answer"}, (path.name, prompts)
        assert set(quoted) <= set(prompts), f"{path.name} quotes {quoted}; buttons say {prompts}"
        seen += len(prompts)
    assert seen >= 10


def test_the_check_catches_a_label_the_button_does_not_show():
    nb = {"cells": [
        {"cell_type": "markdown", "source": ['## 5.6 Worked problems\n', 'The cell ("Click\n',
                                             'to show") answers it.']},
        {"cell_type": "code", "source": ["1 + 1"], "metadata": {"tags": ["hide-cell"]}},
    ]}
    prompts, quoted = folds_and_quotes(nb)
    assert quoted == ["Click to show"] and prompts == ["Show code cell {type}"]
