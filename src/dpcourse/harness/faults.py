"""Faults injected into an emulated cluster while ranks run, and the report of what each rank saw.

:class:`dpcourse.harness.cluster.EmulatedCluster` breaks its own network on request: it slows
one node's cable (a straggler node), cuts it (the link down: a cable pulled, a switch port
lost), brings it back, or kills every process of a node. This module holds what those faults
share:

* :class:`Fault`, the record of one fault: what, on which node, when it was applied;
* :class:`FaultSchedule`, which applies a fault when its moment comes: at a step of the ranks'
  loop (the ranks call :func:`fault_point` with their step, which waits until the faults armed
  at that step are in place, so every rank meets them at the same point of its loop), after some
  seconds, or when a condition becomes true (a checkpoint written: how chapter 8 times a fault
  in a torchrun job, whose trainer knows nothing of the cluster);
* :func:`fault_report`, which turns a failed run's error into the story of the fault: which
  node was lost, in which collective each rank was, what each rank's backend said, with the
  emulated addresses turned into node names, and how long after the fault the run ended.

A cut link does not close a TCP connection: the survivors' packets go unanswered and their
collective waits until the process group's timeout (the cluster's ``collective_timeout``), and
gloo then says "Timed out waiting ... for recv". Killed processes do close theirs: the kernel
answers for the dead process and the survivors read "Connection reset by peer" at once. Neither
message names the node or the collective; the report does.

Chapter 8: training at scale in practice (failures across nodes).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Fault", "FaultSchedule", "fault_point", "fault_report", "FAULT_DIR"]

# The environment variable that tells a rank where its cluster's step files are.
FAULT_DIR = "DPCOURSE_FAULT_DIR"
# How long a rank waits at a fault point for the caller to apply the fault.
_POINT_TIMEOUT = 60.0
# How often the schedule looks at its triggers.
_POLL = 0.005

_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')
_ADDRESS = re.compile(r"\[?(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})\]?(:\d+)?")
_SOURCE_TAG = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:537] "


@dataclass
class Fault:
    """One fault on one node: ``kind`` is ``"slow"``, ``"cut"``, ``"restore"`` or ``"kill"``;
    ``detail`` says what was done (the new rate, the processes killed); ``trigger`` when it was
    asked for (``"now"``, ``"at step 5"``, ``"after 2 s"``, ``"when <condition>"``).
    ``applied_at`` is the ``time.monotonic()`` at which it took effect (None while armed);
    ``error`` what went wrong applying it, if anything."""

    kind: str
    node: int
    trigger: str = "now"
    detail: str = ""
    applied_at: float | None = None
    error: str = ""
    step: int | None = None
    how: dict = field(default_factory=dict, repr=False, compare=False)  # the rate of a slow link
    done: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the fault has been applied; False if ``timeout`` seconds passed first."""
        return self.done.wait(timeout)

    def describe(self) -> str:
        """One line, e.g. ``node 1: link cut (at step 5)``."""
        when = "" if self.trigger == "now" else f" ({self.trigger})"
        return f"node {self.node}: {self.detail or self.kind}{when}"


class FaultSchedule:
    """Faults armed for later, and the thread that applies each when its trigger fires.

    ``apply(fault)`` is the cluster's own method that does the fault; ``control_dir`` the folder
    where ranks leave their step files (see :func:`fault_point`)."""

    def __init__(self, apply: Callable[[Fault], None], control_dir: str):
        self.apply = apply
        self.control_dir = control_dir
        self._armed: list[tuple[Fault, Callable[[], bool]]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def armed(self) -> list[Fault]:
        """The faults waiting for their trigger, in the order they were armed."""
        with self._lock:
            return [f for f, _ in self._armed]

    def arm(
        self,
        fault: Fault,
        at_step: int | None = None,
        after: float | None = None,
        when: Callable[[], bool] | None = None,
    ) -> Fault:
        """Apply ``fault`` when the ranks reach step ``at_step``, ``after`` seconds from now, or
        once ``when()`` returns true (exactly one of the three)."""
        if at_step is not None:
            fault.step = at_step
            fault.trigger = f"at step {at_step}"
            open(self._file("armed", at_step), "a").close()
            reached = self._file("reached", at_step)
            trigger: Callable[[], bool] = lambda: os.path.exists(reached)  # noqa: E731
        elif after is not None:
            due = time.monotonic() + after
            fault.trigger = f"after {after:g} s"
            trigger = lambda: time.monotonic() >= due  # noqa: E731
        else:
            fault.trigger = f"when {getattr(when, '__name__', 'the condition')} is true"
            trigger = when
        with self._lock:
            self._armed.append((fault, trigger))
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="dpcourse-faults",
                                                daemon=True)
                self._thread.start()
        return fault

    def stop(self) -> None:
        """Disarm every fault not yet applied and stop the thread."""
        with self._lock:
            self._armed.clear()
            thread = self._thread
        self._stop.set()
        if thread is not None:
            thread.join(5)

    def _file(self, what: str, step: int) -> str:
        return os.path.join(self.control_dir, f"{what}-{step}")

    def _run(self) -> None:
        while not self._stop.wait(_POLL):
            with self._lock:
                if not self._armed:
                    self._thread = None
                    return
                armed = list(self._armed)
            for fault, trigger in armed:
                try:
                    fired = bool(trigger())
                except Exception as exc:  # a broken condition must not kill the thread
                    fault.error = f"its condition raised {type(exc).__name__}: {exc}"
                    fired = True
                if not fired:
                    continue
                with self._lock:
                    if (fault, trigger) not in self._armed:
                        continue
                    self._armed.remove((fault, trigger))
                if not fault.error:
                    try:
                        self.apply(fault)
                    except Exception as exc:
                        fault.error = f"{type(exc).__name__}: {exc}"
                fault.done.set()
                if fault.step is not None and not any(
                    f.step == fault.step for f, _ in self.armed_pairs()
                ):
                    open(self._file("applied", fault.step), "a").close()  # the ranks go on

    def armed_pairs(self) -> list[tuple[Fault, Callable[[], bool]]]:
        with self._lock:
            return list(self._armed)


def fault_point(step: int) -> None:
    """Call it in a rank's loop with the step about to start: where a fault of the rank's
    emulated cluster is armed at this step (``cluster.cut_link(1, at_step=step)``), the rank
    waits here until the cluster has applied it, so that every rank meets the fault at the same
    point of its loop. Elsewhere (no fault at this step, no cluster) it returns at once."""
    folder = os.environ.get(FAULT_DIR)
    if not folder or not os.path.exists(os.path.join(folder, f"armed-{step}")):
        return
    open(os.path.join(folder, f"reached-{step}"), "a").close()
    applied = os.path.join(folder, f"applied-{step}")
    deadline = time.monotonic() + _POINT_TIMEOUT
    while not os.path.exists(applied):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the fault armed at step {step} was not applied within {_POINT_TIMEOUT:g} s: "
                "the process that holds the EmulatedCluster (the notebook's kernel) must be "
                "alive and the cluster open while its ranks run"
            )
        time.sleep(0.002)


def _collective_of(text: str) -> tuple[str, str]:
    """``(function, caller)`` for a stack or traceback: the ``torch.distributed`` function a
    rank was in (the outermost frame in ``distributed_c10d.py``: ``all_reduce``, ``recv``,
    ``barrier``...) and the frame that called it (``work (cell.py:12)``); empty strings where no
    such frame is there. Tracebacks list the most recent call last, ``faulthandler``'s dumps
    first: both are read."""
    frames = _FRAME.findall(text)
    if "most recent call first" in text:
        frames = frames[::-1]
    for i, (path, _line, name) in enumerate(frames):
        if path.endswith("distributed_c10d.py"):
            callers = [f for f in frames[:i] if "/torch/" not in f[0]]
            caller = ""
            if callers:
                cpath, cline, cname = callers[-1]
                caller = f"{cname} ({os.path.basename(cpath)}:{cline})"
            return name, caller
    return "", ""


def _plain(message: str, node_of_address: dict[str, int]) -> str:
    """A backend's message without its source tag and boilerplate, addresses named as nodes."""
    text = _SOURCE_TAG.sub("", message.strip().splitlines()[0] if message.strip() else "")
    text = text.split(". This is typically caused")[0]

    def name(match: re.Match) -> str:
        node = node_of_address.get(match.group(1))
        return match.group(0) if node is None else f"{match.group(0)} (node {node})"

    return _ADDRESS.sub(name, text)


def fault_report(
    error,
    faults: list[Fault],
    node_of_rank: Callable[[int], int],
    node_of_address: dict[str, int],
    collective_timeout: float | None,
    link_cut: Callable[[int], bool],
) -> str:
    """The story of a failed run on a cluster with ``faults`` (those applied during the run, or
    still in effect): which nodes were lost and what each rank saw, one line each. ``error`` is
    the :class:`dpcourse.harness.launch.RankError` the run raised; its ``failures`` (each rank's
    own error) and ``stacks`` (where each unfinished rank was) are read. Returns "" when there
    is no fault to tell about."""
    if not faults:
        return ""
    now = time.monotonic()
    lost = sorted({f.node for f in faults if f.kind in ("cut", "kill")})
    world = error.world_size
    ranks_of: dict[int, list[int]] = {}
    for rank in range(world):
        ranks_of.setdefault(node_of_rank(rank), []).append(rank)
    lines: list[str] = []
    collectives: list[str] = []
    for rank in range(world):
        node = node_of_rank(rank)
        where = f"rank {rank} (node {node}{', lost' if node in lost else ''})"
        failure = error.failures.get(rank)
        stack = error.stacks.get(rank, "")
        if failure is not None and type(failure).__name__ == "RankDiedError":
            lines.append(f"{where}: {failure.summary.split(' (the machine')[0]}")
            continue
        text = (failure.remote_traceback if failure is not None else "") or stack
        name, caller = _collective_of(text)
        if name:
            collectives.append(name)
        place = f"in {name}" + (f", called from {caller}" if caller else "") if name else (
            "outside any torch.distributed call")
        if failure is not None:
            message = failure.summary.split(": ", 1)[-1]
            lines.append(f"{where}: {place}: {_plain(message, node_of_address)}")
        elif stack:
            lines.append(f"{where}: still {place} when the run was stopped")
        else:
            lines.append(f"{where}: finished its part, or was stopped before it said where")
    first = min(faults, key=lambda f: f.applied_at or now)
    since = now - (first.applied_at or now)
    collective = max(set(collectives), key=collectives.count) if collectives else ""
    head = []
    for node in lost:
        ranks = ", ".join(map(str, ranks_of.get(node, [])))
        what = "; ".join(f.describe().split(": ", 1)[1] for f in faults if f.node == node)
        head.append(f"node {node} (rank{'s' if len(ranks_of.get(node, [])) > 1 else ''} {ranks}) "
                    f"was lost: {what}")
    for fault in faults:
        if fault.node not in lost:
            head.append(fault.describe())
    timeout = (f" (collective timeout {collective_timeout:g} s)" if collective_timeout
               else "")
    text = ("; ".join(head) + "." + (f" The ranks were in {collective} when it happened." if
                                     collective else "")
            + f"\nThe run ended {since:.1f} s after the fault{timeout}. What each rank saw:\n"
            + "\n".join(f"  {line}" for line in lines))
    still_cut = [n for n in lost if link_cut(n)]
    if still_cut:
        calls = " and ".join(f"cluster.restore_link({n})" for n in still_cut)
        text += (f"\nThe link is still cut: call {calls} (or cluster.heal()) before the next "
                 "run, whose ranks on that node could not reach the others.")
    return text
