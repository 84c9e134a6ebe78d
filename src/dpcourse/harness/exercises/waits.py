"""Whether a learner's collectives leave backward running: waits and blocking calls inside it.

Overlap (chapter 7's DDP, chapter 9's ZeRO-2) means launching a collective from a gradient
hook and waiting for it only once backward has computed every gradient. An answer that waits
in the hook, ``dist.all_reduce(t, async_op=True).wait()``, or calls the collective without
``async_op=True``, gives the same numbers with no overlap at all: only watching *when* it
waits tells it apart. :class:`BackwardWatch` does that on one rank:

* :meth:`BackwardWatch.begin`, just before ``loss.backward()``, marks backward as running and
  puts a hook on the loss, the first node backward runs; that hook queues a callback on the
  autograd engine which marks backward as over. The engine runs its final callbacks in the
  order they were queued, so this one runs before any that the learner's gradient hooks queue
  (torch's DDP waits in such a callback): a wait there counts as after backward, rightly.
* :meth:`BackwardWatch.work` wraps the Work of an asynchronous collective so that its
  ``wait()`` is noted with whether backward was still running; :meth:`BackwardWatch.note`
  takes a blocking call. The first one made while backward runs is kept (:class:`Blocked`),
  with the name of the learner's function that made it.

A flag, not a thread-local: on a GPU the autograd engine runs the hooks on threads of its own.
Waiting on ``work.get_future()`` goes unseen (torch's futures accept no stand-in).

Chapter 7: the exercise checks of overlap (chapters 7 and 9).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import Variable

import dpcourse

__all__ = ["Blocked", "BackwardWatch", "is_blocking", "learner_function"]

# Frames in these folders are the check's, the package's or torch's, never the learner's.
_NOT_LEARNER = tuple(str(Path(m.__file__).parent) for m in (dpcourse, torch))


def learner_function() -> str:
    """The name of the innermost function on this thread's stack outside the package and
    torch (the learner's, e.g. ``launch``); "" if there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_NOT_LEARNER):
            return frame.f_code.co_name
        frame = frame.f_back
    return ""


def is_blocking(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether calling the collective ``fn(*args, **kwargs)`` returns only once it is done:
    ``async_op`` left False, or a function without that argument (chapter 6's ring)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: believe its keywords
        return not kwargs.get("async_op", False)
    parameters = signature.parameters
    if "async_op" not in parameters:
        if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            return not kwargs.get("async_op", False)  # a wrapper that does not say: its keywords
        return True
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # called wrongly: the call itself will say so
        return False
    return not bound.arguments.get("async_op", parameters["async_op"].default)


@dataclass(frozen=True)
class Blocked:
    """The first wait made while backward ran: on which collective (``what``, e.g. "bucket 0's
    all-reduce", and ``tag``, an index of the check's own), ``how`` ("waited": ``wait()`` on
    its Work; "blocking": called without ``async_op=True``; "synchronous": a function with no
    asynchronous form) and ``caller``, the learner's function that waited."""

    what: str
    tag: int
    how: str
    caller: str

    def message(self, remedy: str) -> str:
        """What went wrong and why it matters, then ``remedy`` (what to do instead)."""
        where = f" (in {self.caller})" if self.caller.isidentifier() else ""
        if self.how == "waited":
            return (f"{self.what} was waited on inside backward{where}: waiting there blocks "
                    "backward until the communication is done, so nothing overlaps; " + remedy)
        if self.how == "blocking":
            said = f"was called without async_op=True inside backward{where}"
        else:
            said = f"was called inside backward{where}, and it has no async_op"
        return (f"{self.what} {said}: it returns only once the communication is done, so "
                "backward waits for it and nothing overlaps; " + remedy)


class BackwardWatch:
    """Whether backward is computing gradients, and the first wait made meanwhile (``first``)."""

    def __init__(self) -> None:
        self.running = False
        self.first: Blocked | None = None

    def begin(self, loss: torch.Tensor) -> None:
        """Call just before ``loss.backward()``: backward runs until its final callbacks."""
        self.running = True
        if loss.requires_grad:
            loss.register_hook(self._queue_end)

    def _queue_end(self, grad: torch.Tensor) -> None:
        Variable._execution_engine.queue_callback(self.end)

    def end(self) -> None:
        """Backward is over (also called once ``backward()`` has returned, in case)."""
        self.running = False

    def note(self, what: str, tag: int, how: str) -> None:
        """A wait on ``what``: kept if backward is running and it is the first."""
        if self.running and self.first is None:
            self.first = Blocked(what, tag, how, learner_function())

    def work(self, work: Any, what: str, tag: int) -> Any:
        """``work`` (a collective's return value) with its ``wait()`` noted; anything that is
        not a Work (None from a blocking call, a tensor) comes back as it is."""
        if work is None or isinstance(work, torch.Tensor) or not hasattr(work, "wait"):
            return work
        return _WatchedWork(work, self, what, tag)


class _WatchedWork:
    """A collective's Work whose ``wait()`` tells the watch; everything else passes through."""

    def __init__(self, work: Any, watch: BackwardWatch, what: str, tag: int) -> None:
        self._work, self._watch, self._what, self._tag = work, watch, what, tag

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._watch.note(self._what, self._tag, "waited")
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
