"""A Gradescope autograder for one assignment: ``python -m dpcourse.harness.exercises autograder
--chapter 7 --out autograder.zip``.

The zip holds Gradescope's two scripts at its top and the course's package beside them, in
``course/``. Gradescope unpacks it into ``/autograder/source``, runs ``setup.sh`` once when it
builds the autograder's image, and ``run_autograder`` for each submission, with the student's
files in ``/autograder/submission``; the score is what ``run_autograder`` writes to
``/autograder/results/results.json``
(:func:`~dpcourse.harness.exercises.grading.gradescope_results`). ``setup.sh`` installs the
versions the course's ``requirements.txt`` pins (torch's CPU build); ``run_autograder`` names
the assignment, so that a notebook of another chapter is refused.

Chapter 0: the course's tooling (the instructor guide's "Gradescope").
"""

from __future__ import annotations

import re
import shlex
import zipfile
from pathlib import Path

__all__ = ["SETUP", "run_autograder", "PACKAGES", "write_autograder"]

# What the grader needs of requirements.txt, installed at the versions it pins (torch from the
# CPU index: PyPI's Linux build brings gigabytes of CUDA libraries the grader does not use).
PACKAGES = ("torch", "numpy", "matplotlib", "cloudpickle", "ipykernel", "PyYAML")
SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (choose Ubuntu 24.04: its
# Python 3.12 takes requirements.txt's numpy, which needs 3.11 or later). It installs what the
# grader needs, at the versions the course's requirements.txt pins, and the course's package.
set -euo pipefail
apt-get update && apt-get install -y python3 python3-pip python3-venv
python3 -m venv /autograder/venv
pin() { grep -E "^$1==" /autograder/source/course/requirements.txt | cut -d' ' -f1; }
/autograder/venv/bin/pip install "$(pin torch)" --index-url https://download.pytorch.org/whl/cpu
/autograder/venv/bin/pip install "$(pin numpy)" "$(pin matplotlib)" "$(pin cloudpickle)" \\
    "$(pin ipykernel)" "$(pin PyYAML)"
/autograder/venv/bin/pip install --no-deps /autograder/source/course
"""
# The course's files that installing its package needs (pyproject.toml names the readme and
# the licences).
COURSE_FILES = ("pyproject.toml", "requirements.txt", "README.md", "LICENSE",
                "LICENSE-CC-BY-4.0.txt")


def run_autograder(arguments: list[str]) -> str:
    """The script Gradescope runs for each submission: the grader on whatever notebooks the
    student uploaded, as one student, for the assignment ``arguments`` name (``--chapter 7``)."""
    args = " ".join(shlex.quote(a) for a in arguments)
    return f"""#!/usr/bin/env bash
# Gradescope runs this for each submission: the student's files are in /autograder/submission,
# the score goes to /autograder/results/results.json. The assignment: {args}.
cd /autograder/source
/autograder/venv/bin/python -m dpcourse.harness.exercises grade /autograder/submission \\
    {args} --student submission --out /tmp/grades --jobs 1 \\
    --timeout 900 --cell-timeout 300 --gradescope-file /autograder/results/results.json
"""


def write_autograder(root: Path, out: Path, arguments: list[str]) -> list[str]:
    """Write the autograder's zip to ``out`` from the course at ``root``, for the assignment
    that the grade command's ``arguments`` name; the names it holds."""
    root = Path(root)
    missing = [f for f in COURSE_FILES if not (root / f).exists()] + (
        [] if (root / "src" / "dpcourse").is_dir() else ["src/dpcourse"])
    if missing:
        raise FileNotFoundError(f"{root} is not the course's repository (no {', '.join(missing)})")
    pins = (root / "requirements.txt").read_text()
    unpinned = [p for p in PACKAGES if not re.search(rf"^{re.escape(p)}==", pins, re.M)]
    if unpinned:
        raise ValueError(f"requirements.txt pins no version of {', '.join(unpinned)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in (("setup.sh", SETUP), ("run_autograder", run_autograder(arguments))):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope runs them
            z.writestr(info, text)
            names.append(name)
        files = [root / f for f in COURSE_FILES] + sorted(
            p for p in (root / "src").rglob("*") if p.is_file()
            and "__pycache__" not in p.parts and not any(".egg-info" in q for q in p.parts))
        for path in files:
            name = f"course/{path.relative_to(root).as_posix()}"
            z.write(path, name)
            names.append(name)
    return names
