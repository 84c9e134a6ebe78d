"""pytest for the chapters: nbval runs each notebook cell by cell, and keeps what it ran.

``pytest --nbval-lax chapters`` (``make notebooks``) runs every notebook as a test, each code
cell an item. With ``--executed-dir DIR`` each notebook is also written to
``DIR/<its path>.ipynb`` with the outputs that this run produced, so that the website and the
student edition are rendered from the run that tested them and no notebook runs twice
(``make test``). A notebook whose cells raised also gets ``DIR/<its path>.err.log`` with each
traceback, the build report that ``make test`` copies under ``_build/html/reports/``.

Under the device audit, ``DPCOURSE_AUDIT_PLAN="05_collectives=two-gpus bug_hunt=one-gpu ..."``
gives a notebook's kernel (and so its ranks) a machine of its own, set before the kernel starts;
the others get ``DPCOURSE_DEVICE_AUDIT``'s. CI's one pass of ``make audit`` uses it.

The outputs are assembled from the kernel's messages by nbclient, the executor the book
itself uses: display updates, cleared outputs and the widgets' state (from which the website
draws them without a kernel) come out exactly as in a ``make book`` run.

Chapter 0: the course's tooling (the notebooks as tests).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest

try:  # nbval is what runs the cells; without it there is nothing to record
    from nbval.plugin import IPyNbCell
except ImportError:  # pragma: no cover
    IPyNbCell = None

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_AUDIT = "DPCOURSE_DEVICE_AUDIT"
_audit_default = os.environ.get(_AUDIT)  # the machine of the notebooks the plan does not name


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a notebook's kernel starts (nbval starts it in its file's setup, which follows
    this hook), give it the machine ``DPCOURSE_AUDIT_PLAN`` names for it."""
    plan = dict(entry.split("=", 1) for entry in os.environ.get("DPCOURSE_AUDIT_PLAN", "").split())
    if plan and IPyNbCell is not None and isinstance(item, IPyNbCell):
        machine = plan.get(Path(item.parent.path).stem, _audit_default)
        if machine:
            os.environ[_AUDIT] = machine


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--executed-dir",
        metavar="DIR",
        default=None,
        help="write each notebook that nbval runs to DIR, with the outputs of that run",
    )


class _Recorder:
    """One notebook's run: the kernel's messages for each cell, turned into its outputs."""

    def __init__(self, path: Path, out: Path):
        from nbclient import NotebookClient

        self.path, self.out = path, out
        self.nb = nbformat.read(path, as_version=4)
        self.code_cells = [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]
        for i in self.code_cells:
            self.nb.cells[i].outputs = []
            self.nb.cells[i].execution_count = None
        # No kernel of its own: it only reads the messages nbval's kernel sent.
        self.client = NotebookClient(self.nb, record_timing=False)
        self.kernel = None
        self.messages: list[dict] = []
        self.request: str | None = None
        self.errors: list[str] = []
        self.count = 0

    def listen(self, kernel) -> None:
        """Tee every iopub message nbval reads, and note the id of each cell's request."""
        if kernel is self.kernel:
            return
        self.kernel = kernel
        get_message, execute = kernel.get_message, kernel.execute_cell_input

        def get_message_and_keep(stream, timeout=None):
            msg = get_message(stream, timeout=timeout)
            if stream == "iopub":
                self.messages.append(msg)
            return msg

        def execute_and_note(cell_input, allow_stdin=None):
            self.request = execute(cell_input, allow_stdin=allow_stdin)
            return self.request

        kernel.get_message = get_message_and_keep
        kernel.execute_cell_input = execute_and_note

    def cell_done(self, item) -> None:
        """Turn the messages of the cell nbval just ran into that cell's outputs."""
        from nbclient.exceptions import CellExecutionComplete

        index = self.code_cells[item.cell_num]
        cell = self.nb.cells[index]
        self.client.kc = getattr(self.kernel, "kc", None)  # output widgets answer through it
        self.client.clear_before_next_output = False  # as nbclient starts each cell
        for msg in self.messages:
            if self.request is None or msg["parent_header"].get("msg_id") != self.request:
                continue
            try:
                self.client.process_message(msg, cell, index)
            except CellExecutionComplete:
                break
        if self.request is not None:  # nbval runs cells without history: number them here
            self.count += 1
            cell.execution_count = self.count
            for out in cell.outputs:
                if out.output_type == "execute_result":
                    out.execution_count = self.count
        self.messages, self.request = [], None
        for out in cell.outputs:
            if out.output_type == "error":
                tb = _ANSI.sub("", "\n".join(out.traceback))
                self.errors.append(f"Cell {item.cell_num} (notebook cell {index}):\n{tb}\n")

    def write(self) -> None:
        self.client.set_widgets_metadata()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(self.nb, self.out)
        report = self.out.with_suffix(".err.log")
        if self.errors:
            report.write_text(f"{self.path}: cells that raised\n\n" + "\n".join(self.errors))
        else:
            report.unlink(missing_ok=True)


_recorders: dict[str, _Recorder] = {}


def _recorder(item: pytest.Item) -> _Recorder | None:
    target = item.config.getoption("executed_dir")
    if not target or IPyNbCell is None or not isinstance(item, IPyNbCell):
        return None
    nbfile = item.parent
    if nbfile.nodeid not in _recorders:
        path = Path(nbfile.path)
        relative = path.resolve().relative_to(Path(item.config.rootpath).resolve())
        _recorders[nbfile.nodeid] = _Recorder(path, Path(target) / relative)
    return _recorders[nbfile.nodeid]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    recorder = _recorder(item)
    if recorder is not None and item.parent.kernel is not None:
        recorder.listen(item.parent.kernel)
    try:
        yield
    finally:
        if recorder is not None:
            recorder.cell_done(item)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    recorder = _recorder(item)
    if recorder is not None and (nextitem is None or nextitem.parent is not item.parent):
        recorder.write()
        del _recorders[item.parent.nodeid]
