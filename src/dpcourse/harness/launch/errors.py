"""The errors a run on several ranks can end with, and how they read.

:func:`dpcourse.harness.launch.run_ranks` raises one of these in the caller: :class:`RankError`
when a rank raised (with that rank's traceback), :class:`RankDiedError` when a rank's process died,
:class:`RankTimeoutError` when ranks stalled (with the stack each was stuck in). They are
importable from :mod:`dpcourse.harness.launch` too (where learners catch them).

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import linecache
import signal

__all__ = ["RankError", "RankDiedError", "RankTimeoutError"]

# Frames of the rank program itself, cut from the stacks shown to the learner.
_WORKER_FILE = "dpcourse/harness/launch/worker.py"


class RankError(RuntimeError):
    """An exception raised inside a rank, re-raised in the caller.

    ``rank`` is the rank that failed first, ``remote_traceback`` its traceback as text and
    ``original`` the exception itself where it could be sent back (else ``None``). ``others``
    holds one-line summaries of the ranks that failed after it (often as a consequence);
    ``failures`` every failed rank's own error (this one included) and ``stacks`` the stack of
    each rank that was still running when the run was stopped, where it was dumped (on an
    emulated cluster). ``context``, where set (by an emulated cluster that injected a fault:
    :meth:`dpcourse.harness.cluster.EmulatedCluster.explain`), is printed first.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        summary: str,
        remote_traceback: str = "",
        original: BaseException | None = None,
        others: list[str] | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.original = original
        self.others = others or []
        self.failures: dict[int, RankError] = {rank: self}
        self.stacks: dict[int, str] = {}
        self.context = ""
        super().__init__(rank, summary)

    def __str__(self) -> str:
        text = f"rank {self.rank} of {self.world_size} {self.summary}"
        if self.context:
            text = f"{self.context}\n\nThe first error, as rank {self.rank} raised it:\n{text}"
        if self.remote_traceback:
            text += f"\n\n{self._traceback_heading()}\n{self.remote_traceback.rstrip()}"
        if self.others:
            text += "\n\nThen, probably as a consequence:\n" + "\n".join(
                f"  {line}" for line in self.others
            )
        return text

    def _traceback_heading(self) -> str:
        return f"Traceback on rank {self.rank}:"


class RankDiedError(RankError):
    """A rank's process ended without a result (crashed, killed, or called ``os._exit``)."""


class RankTimeoutError(RankError, TimeoutError):
    """Some ranks did not finish within the timeout; ``stalled`` lists them, ``stacks`` has the
    Python stack each one was stuck in (most recent call first)."""

    def __init__(
        self,
        stalled: list[int],
        world_size: int,
        timeout: float,
        stacks: dict[int, str],
        starting: bool = False,
    ):
        self.stalled = stalled
        what = "start" if starting else "finish"
        summary = (
            f"did not {what} within the timeout of {timeout:g} s and were killed. A rank waiting "
            "in a collective or a recv that another rank never joins waits forever: compare the "
            "stacks below, or raise `timeout=` if the work is just slow."
        )
        stack_text = "\n".join(
            f"--- rank {r} was here (most recent call first):\n{stacks[r].rstrip()}"
            for r in stalled
            if stacks.get(r)
        )
        super().__init__(stalled[0], world_size, summary, stack_text)
        self.failures = {}  # no rank failed: they stalled
        self.stacks = stacks

    def __str__(self) -> str:
        head = f"ranks {self.stalled}" if len(self.stalled) > 1 else f"rank {self.stalled[0]}"
        text = f"{head} of {self.world_size} {self.summary}"
        if self.context:
            text = f"{self.context}\n\nThe error:\n{text}"
        if self.remote_traceback:
            text += f"\n\n{self.remote_traceback.rstrip()}"
        return text


# ------------------------------------------------------------------------------------- helpers
def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def annotate_stack(text: str) -> str:
    """Add source lines (known to this process's linecache) to a faulthandler dump."""
    out = []
    for line in text.splitlines():
        out.append(line)
        stripped = line.strip()
        if stripped.startswith('File "') and '", line ' in stripped:
            try:
                name, rest = stripped[6:].split('", line ', 1)
                src = linecache.getline(name, int(rest.split()[0])).strip()
            except (ValueError, IndexError):
                src = ""
            if src:
                out.append(f"    {src}")
    return "\n".join(out)


def learner_stack(dump: str) -> str:
    """The learner's part of a faulthandler dump: the worker's parent-watching thread and the
    frames below the learner's function (the worker's loop, runpy) are dropped."""
    blocks, current = [], []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) and current:
            blocks.append(current)
            current = []
        current.append(line)
    if current:
        blocks.append(current)
    kept = []
    for block in blocks:
        if any("_watch_parent" in line for line in block):
            continue
        lines = block[1:]  # "Current thread 0x... (most recent call first):"
        cut = next((i for i, line in enumerate(lines) if _WORKER_FILE in line), len(lines))
        kept.append("\n".join(lines[:cut]))
    return "\n".join(kept)
