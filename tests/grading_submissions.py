"""Submissions for the grader's tests (tests/test_grading*.py): honest ones (right, partly right,
wrong, crashing) on chapters 1, 3 and 7, and adversarial ones that try to get points without
answering. Each is a small notebook laid out as a chapter's: an exercise's label in the markdown
above its code, the course's imports, lesson cells, the student's functions and check cells.

The right answers are the book's own (the code between the solution markers of the chapter's
notebook), so that they stay right when a check changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

# The exercises each chapter's submissions answer (the tests' assignments).
CH1 = ["ex-1-batch", "ex-1-max-batch"]
CH3 = ["ex-3-chunk", "ex-3-replicas"]
CH7 = ["ex-7-buckets", "ex-7-sampler", "ex-7-average"]
IMPORTS = {
    "1": "import torch\nfrom dpcourse.one_device import memory, models\n"
         "from dpcourse.harness.exercises import check",
    "3": "import copy\nimport torch\nfrom dpcourse.replicas import replication, scatter_gather\n"
         "from dpcourse.harness.exercises import check",
    "7": "import torch\nimport torch.distributed as dist\nfrom dpcourse.ddp import buckets, ddp, "
         "sampler\nfrom dpcourse.harness.exercises import check",
}
CHECKS = {"ex-1-batch": "check.batch_growth(growth_when_batch_doubles)",
          "ex-1-max-batch": "check.max_batch_size(my_max_batch_size)",
          "ex-3-chunk": "check.chunk_data(my_chunk_data)",
          "ex-3-replicas": "check.create_replicas(my_create_replicas)",
          "ex-7-buckets": "check.bucket_assignment(my_bucket_assignment)",
          "ex-7-sampler": "check.epoch_indices(my_epoch_indices)",
          "ex-7-average": "check.all_reduce_gradients(my_all_reduce_gradients)"}
PAGES = {"1": "01_single_device", "3": "03_manual_replication", "7": "07_ddp"}


def book_answer(part: str, function: str) -> str:
    """The book's answer: the solution cell of chapter ``part`` that defines ``function``, its
    solution markers removed."""
    nb = json.loads((ROOT / "chapters" / f"{PAGES[part]}.ipynb").read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and re.search(rf"^def {function}\(", source, re.M):
            return re.sub(r"^\s*# (BEGIN|END) SOLUTION\n", "", source, flags=re.M)
    raise LookupError(f"no solution defines {function} in chapter {part}")


def notebook(part: str, answers: dict[str, str], before: list[str] = (),
             between: list[str] = ()) -> nbformat.NotebookNode:
    """A chapter-``part`` notebook: the imports, the lesson cells ``before``, then for each
    exercise (label -> the student's code cell) its labelled statement, the student's cell and
    its check cell; the cells ``between`` come after the first exercise."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    cells = [nbformat.v4.new_markdown_cell(f"# Chapter {part}"),
             nbformat.v4.new_code_cell(IMPORTS[part])]
    cells += [nbformat.v4.new_code_cell(c) for c in before]
    for i, (label, code) in enumerate(answers.items()):
        statement = f"```{{exercise}}\n:label: {label}\nDo it.\n```"
        cells.append(nbformat.v4.new_markdown_cell(statement))
        cells.append(nbformat.v4.new_code_cell(code, metadata={"tags": ["solution"]}))
        cells.append(nbformat.v4.new_code_cell(CHECKS[label]))
        if i == 0:
            cells += [nbformat.v4.new_code_cell(c) for c in between]
    nb.cells = cells
    return nb


# ------------------------------------------------------------------------------------- honest
WRONG = {
    # forward order: bucket 0 starts from the first parameter
    "ex-7-buckets": """
def my_bucket_assignment(param_bytes, cap_bytes):
    out, current, size = [], [], 0
    for i in range(len(param_bytes)):
        current.append(i)
        size += param_bytes[i]
        if size >= cap_bytes:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])
""",
    # a contiguous block of the permutation instead of every N-th index
    "ex-7-sampler": """
def my_epoch_indices(num_samples, world_size, rank, epoch, seed):
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=g).tolist()
    per_rank = -(-num_samples // world_size)
    order += order[: per_rank * world_size - num_samples]
    return order[rank * per_rank:(rank + 1) * per_rank]
""",
    # the sum over the ranks, not the mean
    "ex-7-average": """
def my_all_reduce_gradients(module):
    for p in module.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad)
""",
    "ex-1-batch": """
def growth_when_batch_doubles():
    return {"parameters": 2, "gradients": 2, "optimizer_state": 2, "activations": 2}
""",
    # one sample too many
    "ex-1-max-batch": """
def my_max_batch_size(model, sample, gpu_memory_bytes, optimizer="adam"):
    one = memory.estimate_training_memory(model, sample, optimizer)
    fixed = one.parameters + one.gradients + one.optimizer_state
    return max(0, (gpu_memory_bytes - fixed) // one.activations + 1)
""",
    # drops the remainder
    "ex-3-chunk": """
def my_chunk_data(batch, n):
    if len(batch) < n or len(batch) == 0:
        raise ValueError("too few samples")
    size = len(batch) // n
    return [batch[i * size:(i + 1) * size] for i in range(n)]
""",
    # the same model n times, not copies
    "ex-3-replicas": """
def my_create_replicas(model, devices):
    return [model for _ in devices]
""",
}
CRASHING = {
    label: re.sub(r"(def \w+\(.*\):\n)", r"\1    raise IndexError('list index out of range')\n",
                  code, count=1)
    for label, code in WRONG.items()
}
# A lesson cell of the chapter that fails (chapter 7's overlap timing did, on a busy machine) and
# one that takes a while: neither is the student's.
COURSE_CELLS = ["assert 0.2 < 0.1, 'the overlap saved less than the model says (a busy machine)'",
                "__import__('time').sleep(3)  # a benchmark"]


def honest(part: str, labels: list[str]) -> dict[str, nbformat.NotebookNode]:
    """Right, partly right (the first answer right, the others wrong), wrong and crashing
    notebooks of chapter ``part``, each with the failing and slow lesson cells."""
    right = {label: book_answer(part, CHECKS[label].split("(")[1].rstrip(")")) for label in labels}
    partly = {label: right[label] if i == 0 else WRONG[label] for i, label in enumerate(labels)}
    make = {"right": right, "partly": partly, "wrong": {k: WRONG[k] for k in labels},
            "crashing": {k: CRASHING[k] for k in labels}}
    return {name: notebook(part, answers, before=COURSE_CELLS) for name, answers in make.items()}


# --------------------------------------------------------------------------------- adversarial
STUBS = {label: f"def {CHECKS[label].split('(')[1].rstrip(')')}(*args, **kwargs):\n"
                "    raise NotImplementedError('Write your solution here')\n"
         for label in CHECKS}
# Issue 44's submission, and more: replace the grader's machinery and the checks in the kernel,
# and report every exercise passed. (The grader of main: grading.check_namespace logged what the
# checks said; core.run_check ran them.)
REPLACE_CHECKS = """
import json, os
import dpcourse.harness.exercises as exercises
from dpcourse.harness.exercises import core
from dpcourse.harness.exercises import grading
def forged(namespace, chapter, *rest):
    for ex in core.registry().values():
        if ex.part == str(chapter):
            with open(os.environ["DPCOURSE_GRADE_LOG"], "a") as f:
                f.write(json.dumps({"label": ex.label, "name": ex.name, "status": "passed",
                                    "message": "forged"}) + "\\n")
def forged_check(label, fn):
    return core.CheckResult(label, core.registry()[label].name, "passed", "forged")
grading.check_namespace = forged
core.run_check = forged_check
exercises.run_check = forged_check
for ex in list(core.registry().values()):
    core._registry[ex.label] = core.Exercise(ex.label, ex.name, ex.function,
                                             lambda fn: "forged", ex.timeout)
"""
# The grading log the grader of main read when a kernel died, written by the notebook itself;
# and the checks' passing output printed as a check cell shows it.
WRITE_LOG = """
import json, os
from dpcourse.harness.exercises import core
for ex in core.registry().values():
    forged = core.CheckResult(ex.label, ex.name, "passed", "forged")
    for path in [os.environ.get("DPCOURSE_GRADE_LOG"), "grade-log.jsonl"]:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"label": ex.label, "name": ex.name, "status": "passed",
                                    "message": "forged"}) + "\\n")
    print(forged.text())
"""
# Print passes, write the log, then end the kernel before any check can run.
EXIT_AFTER_FORGED_PASS = WRITE_LOG + "\nos._exit(0)\n"
# The reference and torch's comparisons replaced in the kernel: the check compares the answer
# with itself.
REPLACE_REFERENCES = """
import torch
buckets.bucket_assignment = lambda sizes, cap: my_bucket_assignment(sizes, cap)
torch.equal = lambda *args, **kwargs: True
torch.allclose = lambda *args, **kwargs: True
torch.testing.assert_close = lambda *args, **kwargs: None
"""
# The determined version: the answers themselves replace the check's reference when called, in
# whatever process runs them.
PATCHING_ANSWER_7 = """
def my_bucket_assignment(param_bytes, cap_bytes):
    import dpcourse.ddp.buckets as b
    import dpcourse.harness.exercises.ch07 as c
    fake = lambda sizes, cap: [[0]]
    b.bucket_assignment = c.buckets.bucket_assignment = fake
    return [[0]]
"""
PATCHING_ANSWER_1 = """
def my_max_batch_size(model, sample, gpu_memory_bytes, optimizer="adam"):
    import dpcourse.harness.exercises.ch01 as c
    class Memory:
        def __getattr__(self, name):
            return getattr(memory, name)
        def max_batch_size(self, *args):
            return 0
    c.memory = Memory()
    return 0
"""
COURSE_FUNCTIONS = {
    "ex-7-buckets": "my_bucket_assignment = buckets.bucket_assignment",
    "ex-7-average": "my_all_reduce_gradients = ddp.all_reduce_gradients",
    "ex-7-sampler": "def my_epoch_indices(num_samples, world_size, rank, epoch, seed):\n"
                    "    return sampler.epoch_indices(num_samples, world_size, rank, epoch, seed)",
}
# The loops sleep, so that they take no core from the tests running beside them.
LOOP = "import time\nwhile True:  # never ends\n    time.sleep(0.05)"
KILL = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
# A function that loops, one that kills its process, and a value the answer needs whose cell
# loops or kills.
LOOPING_ANSWER = ("def my_chunk_data(batch, n):\n    import time\n    while True:\n"
                  "        time.sleep(0.05)")
KILLING_ANSWER = ("def my_epoch_indices(num_samples, world_size, rank, epoch, seed):\n"
                  "    import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)")
NEEDS_A_LOOPING_CELL = ("import time\nLIMIT = 0\nwhile True:\n    LIMIT += 1\n"
                        "    time.sleep(0.05)\n"
                        "def my_bucket_assignment(param_bytes, cap_bytes):\n    return LIMIT")


def adversarial() -> dict[str, tuple[str, nbformat.NotebookNode]]:
    """Submissions that try to score without answering, by name: (what it does, notebook).
    Their chapter-7 answers are stubs or wrong unless said otherwise."""
    right = {label: book_answer("7", CHECKS[label].split("(")[1].rstrip(")")) for label in CH7}
    stubs = {label: STUBS[label] for label in CH7}
    wrong = {label: WRONG[label] for label in CH7}
    out = {
        "replace-checks": ("replaces the grader's check_namespace, run_check and every check in "
                           "the kernel, logging passes (issue 44's submission); stubs",
                           notebook("7", stubs, between=[REPLACE_CHECKS])),
        "write-log": ("writes passes to the grading log and prints them; wrong answers",
                      notebook("7", wrong, between=[WRITE_LOG])),
        "exit-after-forged-pass": ("prints and logs passes, then ends its kernel (os._exit(0)); "
                                   "wrong answers",
                                   notebook("7", wrong, between=[EXIT_AFTER_FORGED_PASS])),
        "replace-references": ("replaces the check's reference and torch's comparisons in the "
                               "kernel; wrong answers", notebook("7", wrong,
                                                                 between=[REPLACE_REFERENCES])),
        "patching-answer": ("an answer (7.3) that replaces the check's reference when called, in "
                            "the process running it; the others wrong",
                            notebook("7", {**wrong, "ex-7-buckets": PATCHING_ANSWER_7})),
        "course-functions": ("answers with the package's own functions (an alias, a wrapper)",
                             notebook("7", COURSE_FUNCTIONS)),
        "looping-cell": ("a lesson cell that never ends, before right answers",
                         notebook("7", right, before=[LOOP])),
        "killing-cell": ("a cell that kills its kernel (SIGKILL), before right answers",
                         notebook("7", right, before=[KILL])),
        "killing-answer": ("7.4 kills its own process when called; 7.1, 7.3 right",
                           notebook("7", {**right, "ex-7-sampler": KILLING_ANSWER})),
        "needs-a-looping-cell": ("7.3 needs a value whose cell never ends; 7.1, 7.4 right",
                                 notebook("7", {**right,
                                                "ex-7-buckets": NEEDS_A_LOOPING_CELL})),
    }
    return out


def adversarial_other() -> dict[str, tuple[str, nbformat.NotebookNode]]:
    """Chapter 1: an answer that replaces the check's reference when called, on an exercise
    checked in the player (ex-1-max-batch hands the function a model): what the grader cannot
    stop (the instructor guide says so). Chapter 3: an answer that never returns (ex-3-chunk's
    check allows 10 s)."""
    return {
        "patching-answer-local": (
            "an answer (1.3) that replaces the check's reference when called, in the process "
            "that runs the check; 1.1 wrong",
            notebook("1", {"ex-1-batch": WRONG["ex-1-batch"],
                           "ex-1-max-batch": PATCHING_ANSWER_1})),
        "looping-answer": ("an answer (3.1) that never returns", notebook(
            "3", {"ex-3-chunk": LOOPING_ANSWER})),
    }


def write_all(folder: Path) -> dict[str, list[str]]:
    """Every submission above as ``folder/<chapter>/<name>.ipynb``; the exercises of each
    chapter's folder."""
    folder = Path(folder)
    groups = {"1": (CH1, {**honest("1", CH1)}), "3": (CH3, honest("3", CH3)),
              "7": (CH7, honest("7", CH7))}
    for name, (_, nb) in adversarial().items():
        groups["7"][1][name] = nb
    for name, (_, nb) in adversarial_other().items():
        groups["1" if "local" in name else "3"][1][name] = nb
    for part, (_, notebooks) in groups.items():
        (folder / part).mkdir(parents=True, exist_ok=True)
        for name, nb in notebooks.items():
            nbformat.write(nb, folder / part / f"{name}.ipynb")
    return {part: labels for part, (labels, _) in groups.items()}
