"""The machinery behind every exercise check: registry, comparisons, timeouts, results.

A check is a function that takes the learner's function, runs it on chosen inputs, compares
with the package's reference, and either returns a short success message or raises
:class:`Mismatch` with a message that says which input failed, what was expected and what came
back. Register it with :func:`exercise`::
    @exercise("ex-3-chunk", function="my_chunk_data")
    def chunk_data(fn) -> str:
        ...
        return "splits batches like torch.chunk"

Learners call it as ``check.chunk_data(my_chunk_data)`` (see :data:`check`); the grader calls
it with the function named ``function`` found in a submitted notebook.

A check tries the inputs its statement allows and watches the properties it promises, so that
the wrong answers students write fail (issue 43's four kinds; the instructor guide's table says
what each check verifies). The helpers: :func:`call_learner` (an error in the learner's code
reported at their line), :func:`call_learner_untouched` (their inputs must come back unchanged),
:func:`call_learner_in_place`, :func:`about` (the input a failure was on), :func:`expect_type`,
:func:`expect_close`, :func:`shares_memory` (views, tensors shared between replicas),
:func:`collectives_called` (which collectives, in which dtype); and in
:mod:`~dpcourse.harness.exercises.devices`, :func:`~dpcourse.harness.exercises.devices.as_on_gpus`
(devices modelled on a CPU with the device audit's tags).

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import contextlib
import copy
import html
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dpcourse.collectives as ours
from dpcourse import runtime
from dpcourse.harness import device_audit
from dpcourse.harness.device_audit.tags import tensors_in_args
from dpcourse.harness.exercises import exercise_numbers, numbering
from dpcourse.harness.launch import RankError, RankTimeoutError, run_ranks
from dpcourse.harness.patching import (
    LIBRARY_COLLECTIVES,
    library_collectives_forbidden,
    replaced,
)

__all__ = [
    "Mismatch",
    "CheckResult",
    "Exercise",
    "exercise",
    "registry",
    "call_learner",
    "call_learner_untouched",
    "call_learner_in_place",
    "learner_error",
    "about",
    "expect_type",
    "shares_memory",
    "collectives_called",
    "run_learner_on_ranks",
    "any_rank",
    "expect_close",
    "expect_equal",
    "run_check",
    "not_attempted",
    "display_output",
    "check",
    "DEFAULT_CHECK_TIMEOUT",
    "exercise_title",
]

DEFAULT_CHECK_TIMEOUT = 60.0
# Set by `make book` for the full edition: a reference solution that fails its check fails the
# build. Learners' notebooks and the student edition never raise on a failed check.
STRICT_ENV = "DPCOURSE_CHECKS_STRICT"
# Set by the grader: every check result is appended to this file as one JSON line.
LOG_ENV = "DPCOURSE_GRADE_LOG"


class Mismatch(AssertionError):
    """The learner's answer is wrong; the message says where and how."""


class NotAttempted(Exception):
    """The learner's function still raises the student edition's NotImplementedError."""


class CheckTimeout(Exception):
    """The learner's code ran longer than the check allows."""


@dataclass(frozen=True)
class Exercise:
    label: str  # the sphinx-exercise label, e.g. "ex-3-chunk"
    name: str  # the check's name: check.<name>(fn)
    function: str | None  # the learner's function the grader looks for, e.g. "my_chunk_data"
    check: Callable[[Callable], str]
    timeout: float

    @property
    def part(self) -> str:
        """The label's part: a chapter's number ("5") or an appendix's name ("lab")."""
        return numbering.parse_label(self.label)[0]

    @property
    def chapter(self) -> int:
        """The chapter's number; for an appendix's exercise, which has none, a number past
        every chapter's (100 and up, in the book's order), so that sorting keeps the book's."""
        part = self.part
        return int(part) if part.isdigit() else 100 + list(numbering.APPENDICES).index(part)

    @property
    def number(self) -> str | None:
        """The exercise's number in the book ("5.2", "Lab.1"; see ``numbering``)."""
        return numbering.number_of(self.label)


@dataclass
class CheckResult:
    """What one check said: ``status`` is passed, failed, not attempted or error."""

    label: str
    name: str
    status: str
    message: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def text(self) -> str:
        """One line, headed by the exercise's number as the book's heading shows it:
        ``✓ Exercise 5.2 (ex-5-rounds): passed. ...``."""
        mark = {"passed": "✓", "not attempted": "…"}.get(self.status, "✗")
        return f"{mark} {exercise_title(self.label)}: {self.status}. {self.message}"

    def html(self) -> str:
        colour = {"passed": "#1a7f37", "not attempted": "#6e7781"}.get(self.status, "#cf222e")
        head, rest = self.text().split(":", 1)
        return (
            f'<div style="border-left:4px solid {colour};padding:4px 10px;margin:4px 0">'
            f'<b style="color:{colour}">{html.escape(head)}</b>: '
            # one space after the colon: the message's own would show twice (pre-wrap)
            f'<span style="white-space:pre-wrap">{html.escape(rest.lstrip())}'
            "</span></div>"
        )


def display_output(result: CheckResult) -> dict[str, Any]:
    """The notebook output that showing ``result`` in a notebook produces (nbformat 4)."""
    return {
        "output_type": "display_data",
        "data": {"text/html": result.html(), "text/plain": "<IPython.core.display.HTML object>"},
        "metadata": {},
    }


def exercise_title(label: str) -> str:
    """``"Exercise 5.2 (ex-5-rounds)"``: the number the book's heading shows and the label that
    the checks, the grader and the instructor guide use (the label alone where the book has no
    exercise of that label)."""
    number = numbering.number_of(label)
    return f"Exercise {number} ({label})" if number else f"Exercise {label}"


_registry: dict[str, Exercise] = {}


def exercise(
    label: str, function: str | None = None, timeout: float = DEFAULT_CHECK_TIMEOUT
) -> Callable[[Callable[[Callable], str]], Callable[[Callable], str]]:
    """Register a check for the exercise ``label`` (``ex-<chapter>-<slug>``, or on an appendix
    page ``ex-lab-<slug>``, ``ex-bugs-<slug>``: see ``numbering``).

    ``function`` is the name the learner's function has in the notebook (the grader looks it
    up); ``timeout`` bounds the whole check in seconds.
    """
    numbering.parse_label(label)  # a ValueError that says what a label looks like

    def register(fn: Callable[[Callable], str]) -> Callable[[Callable], str]:
        if label in _registry and _registry[label].check is not fn:
            raise ValueError(f"two checks registered for {label!r}")
        _registry[label] = Exercise(label, fn.__name__, function, fn, timeout)
        return fn

    return register


def registry() -> dict[str, Exercise]:
    """Every registered exercise by label (imports all the chapters' check modules)."""

    # import here: a cycle (it imports this)
    from dpcourse.harness.exercises import load_all  # noqa: PLC0415

    load_all()
    order = {label: i for i, label in enumerate(exercise_numbers.NUMBERS)}  # the book's
    return dict(sorted(_registry.items(),
                       key=lambda kv: (kv[1].chapter, order.get(kv[0], len(order)), kv[0])))


# ----------------------------------------------------------------------------- running learner code
@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise CheckTimeout in this thread after ``seconds`` (main thread on POSIX only; elsewhere
    the grader's per-notebook timeout is the backstop). An interval timer that is already set
    (pytest-timeout's, say) is re-armed afterwards with the time it has left."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < outer_left <= seconds:  # the outer timer fires first anyway
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"it was still running after {seconds:g} s")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            left = max(outer_left - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        body = str(value.tolist()) if value.numel() <= 12 else f"{value.numel()} values"
        return f"tensor of shape {tuple(value.shape)}, {value.dtype}: {body}"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"


def describe_value(value: Any) -> str:
    """``value`` as the checks' messages show an input (a tensor by its shape, dtype and
    values): for the grader's messages about a call of the learner's function."""
    return _describe(value)


def call_learner(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call the learner's ``fn``; an exception it raises becomes a :class:`Mismatch` saying so.

    The student edition's ``NotImplementedError`` becomes "not attempted". Inputs are cloned
    where they are tensors, so a function that modifies its input cannot corrupt the check.
    """
    return _call(fn, args, kwargs, clone=True)


def call_learner_in_place(fn: Callable, *args: Any) -> Any:
    """Call ``fn(*args)`` as :func:`call_learner` does, on the check's own objects rather than
    clones: for a function whose job is to change them (a gradient hook, an in-place
    collective)."""
    return _call(fn, args, {}, clone=False)


def _call(fn: Callable, args: tuple, kwargs: dict, clone: bool) -> Any:
    cloned = [a.clone() if clone and isinstance(a, torch.Tensor) else a for a in args]
    try:
        return fn(*cloned, **kwargs)
    except NotImplementedError as exc:
        raise NotAttempted(str(exc) or "the function is not written yet") from exc
    except (Mismatch, CheckTimeout):
        raise
    except Exception as exc:
        raise learner_error(fn, exc, args) from exc


def learner_error(fn: Callable, exc: Exception, args: tuple = ()) -> Mismatch:
    """The :class:`Mismatch` that says the learner's ``fn`` raised ``exc`` (when called with
    ``args``), at their own line: for an exception that reaches the check some other way than
    through :func:`call_learner` (out of ``backward()``, from a hook of theirs)."""
    inputs = ", ".join(_describe(a) for a in args)
    where = _learner_frame(fn, exc)
    if isinstance(exc, device_audit.DeviceAuditError):  # raised under as_on_gpus
        what = str(exc).split(" (Found by the device audit")[0]
        return Mismatch(
            f"on a machine with GPUs (which this check models on the CPU) your function "
            f"fails at line {where.lineno} ({where.line!s}): {what}"
        )
    return Mismatch(
        f"your function raised {type(exc).__name__}: {exc} (line {where.lineno}: "
        f"{where.line!s})" + (f" when called with ({inputs})" if args else "")
    )


def _learner_frame(fn: Callable, exc: BaseException) -> traceback.FrameSummary:
    """The last line of the learner's own code in ``exc``'s traceback (the last line of all
    where none is theirs, a lambda's say)."""
    frames = traceback.extract_tb(exc.__traceback__)
    # a stand-in for a function run elsewhere (the grader's) names the file of its code
    mine = getattr(fn, "learner_file", None) or getattr(getattr(fn, "__code__", None),
                                                        "co_filename", None)
    if mine is None:  # a class, or a callable object: the file its class was written in
        mine = getattr(getattr(type(fn), "__init__", None), "__code__", None)
        mine = getattr(mine, "co_filename", None)
    return next((f for f in reversed(frames) if f.filename == mine), frames[-1])


@contextlib.contextmanager
def about(what: str) -> Iterator[None]:
    """Prefix the message of a :class:`Mismatch` raised inside with ``what``: the input it was
    raised on, in the learner's terms ("shards of sizes [10, 30]: ...")."""
    try:
        yield
    except Mismatch as exc:
        raise Mismatch(f"{what}: {exc}") from exc.__cause__


def expect_type(got: Any, kind: type | tuple[type, ...], what: str, hint: str = "") -> None:
    """Raise :class:`Mismatch` unless ``got`` is a ``kind`` (a bool is no number here), so that a
    check never fails inside its own code on an answer of another type."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(got, kinds) and not (isinstance(got, bool) and bool not in kinds):
        return
    names = " or ".join(k.__name__ for k in kinds)
    raise Mismatch(f"{what}: expected {names}, got {type(got).__name__} {_describe(got)}"
                   + (f". {hint}" if hint else ""))


def _snapshot(value: Any) -> Any:
    """A copy of ``value`` to compare with after the learner's call: tensors cloned, a module as
    its state and gradients, containers copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, nn.Module):
        state = {k: v.detach().clone() for k, v in value.state_dict().items()}
        grads = {n: p.grad.detach().clone() for n, p in value.named_parameters()
                 if p.grad is not None}
        return _ModuleState(state, grads)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_snapshot(v) for v in value]
    try:
        return copy.deepcopy(value)
    except Exception:  # what cannot be copied is not compared
        return _ModuleState({}, {})


@dataclass
class _ModuleState:
    state: dict
    grads: dict


def _same_tensor(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return a.device == b.device
    a, b = a.detach().cpu(), b.detach().cpu()  # both on the host, also under as_on_gpus
    return bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                      and torch.equal(a.nan_to_num(), b.nan_to_num())))


def _first_change(before: Any, after: Any, path: str) -> str | None:
    """Where ``after`` differs from the snapshot ``before`` (a path such as ``shard_grads[0]``),
    or None."""
    if isinstance(before, torch.Tensor):
        return None if _same_tensor(before, after) else path
    if isinstance(before, _ModuleState):
        if not isinstance(after, nn.Module):
            return None if not before.state else path
        now = after.state_dict()
        for k, v in before.state.items():
            if k not in now or not _same_tensor(v, now[k]):
                return f"{path}.{k}"
        grads = {n: p.grad for n, p in after.named_parameters() if p.grad is not None}
        for k in sorted(set(grads) | set(before.grads)):
            if k not in grads or k not in before.grads or not _same_tensor(before.grads[k],
                                                                          grads[k]):
                return f"{path}.{k}.grad"
        return None
    if isinstance(before, dict):
        if not isinstance(after, dict) or set(after) != set(before):
            return path
        return next((found for k in before
                     if (found := _first_change(before[k], after[k], f"{path}[{k!r}]"))), None)
    if isinstance(before, list):
        if not isinstance(after, list | tuple) or len(after) != len(before):
            return path
        return next((found for i, (b, a) in enumerate(zip(before, after, strict=True))
                     if (found := _first_change(b, a, f"{path}[{i}]"))), None)
    try:
        return None if bool(before == after) else path
    except Exception:
        return None


def call_learner_untouched(fn: Callable, names: Sequence[str], *args: Any) -> Any:
    """Call ``fn(*args)`` as :func:`call_learner` does, but with the check's own arguments (not
    clones, so that what it returns can be compared with them: views, aliasing), and raise
    :class:`Mismatch` if the call changed one of them (``names``: the arguments' names in the
    statement, ``"shard_grads"``)."""
    before = [_snapshot(a) for a in args]
    got = _call(fn, args, {}, clone=False)
    for name, b, a in zip(names, before, args, strict=False):
        changed = _first_change(b, a, name)
        if changed:
            raise Mismatch(
                f"your function changed its argument {changed} (in place: +=, add_, mul_, "
                "copy_, reverse(), sort(), ...). The exercise does not ask for that, and the "
                "caller still needs what it passed: compute into new tensors or lists"
            )
    return got


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` use one storage (writing one can change the other)."""
    if "meta" in (a.device.type, b.device.type):
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.nbytes() > 0 and sa.data_ptr() == sb.data_ptr()


def run_learner_on_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 30.0, **kwargs: Any
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks (for collective exercises).

    A raise on a rank, a dead rank or a deadlock becomes a :class:`Mismatch` naming the rank;
    a deadlock's message shows where each rank was waiting.
    """

    try:
        return run_ranks(fn, world_size, *args, timeout=timeout, **kwargs)
    except RankTimeoutError as exc:
        stuck = ", ".join(map(str, exc.stalled))
        raise Mismatch(
            f"on {world_size} ranks your code did not finish within {timeout:g} s: ranks "
            f"[{stuck}] were still waiting. A deadlock? Every blocking send needs a matching "
            f"receive posted on the other rank (isend/irecv avoid the wait).\n"
            + exc.remote_traceback
        ) from None
    except RankError as first:
        # A rank that found the mistake (a Mismatch) is the one to report, not a rank that
        # failed after it, because it had left (gloo's "Connection closed by peer")
        failures = [first, *(f for r, f in sorted(first.failures.items()) if f is not first)]
        exc = next((f for f in failures if isinstance(f.original, Mismatch | NotAttempted
                                                      | NotImplementedError)), first)
        if isinstance(exc.original, NotImplementedError | NotAttempted):
            raise NotAttempted(str(exc.original) or "the function is not written yet") from None
        if isinstance(exc.original, Mismatch):  # a comparison made on the rank itself
            raise Mismatch(f"on rank {exc.rank} of {world_size}: {exc.original}") from None
        shown = _without_check_frames(exc.remote_traceback)
        raise Mismatch(f"on {world_size} ranks: rank {exc.rank} of {world_size} {exc.summary}"
                       + (f"\n\n{shown}" if shown else "")) from None


# Frames of the checks and of the launcher: what a learner's traceback from a rank is cut to
# show (their own code, and the library calls it made)
_CHECK_FRAMES = ("/dpcourse/harness/",)


def _without_check_frames(text: str) -> str:
    """A rank's traceback without the frames of the check's and the launcher's own code."""
    lines, kept, skipping = text.rstrip().splitlines(), [], False
    for line in lines:
        if line.startswith("  File "):
            skipping = any(part in line for part in _CHECK_FRAMES)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept) if any(k.startswith("  File ") for k in kept) else ""


@contextlib.contextmanager
def learner_messages(dtype: torch.dtype | None = None) -> Iterator[list[tuple[int, int]]]:
    """While a learner's collective runs on a rank: log every message of floating-point data it
    sends, as ``(peer, bytes)`` (``dist.send``, ``dist.isend`` and the sends of
    ``dist.batch_isend_irecv``), and make torch.distributed's own collectives raise
    ``AssertionError`` (the learner must build the collective from messages). Chapters 5 and 6's
    checks use it to tell a tree from a relay and a ring from a gather. With ``dtype`` (the
    tensor's), a message of floating-point data in another dtype raises ``TypeError`` before it
    is sent or received: gloo aborts the process on a message that does not fit its buffer."""

    log: list[tuple[int, int]] = []
    inside = threading.local()  # torch's send calls its isend: count the outer call only

    def same_dtype(tensor: Any, what: str) -> None:
        if (dtype is not None and isinstance(tensor, torch.Tensor)
                and tensor.is_floating_point() and tensor.dtype != dtype):
            raise TypeError(
                f"dist.{what} of a {tensor.dtype} tensor, while the tensor being reduced is "
                f"{dtype}: the other rank's message would not fit (gloo aborts the process). "
                "Make buffers like the tensor: t.new_empty(n), torch.empty_like(t), or "
                "dtype=t.dtype, device=t.device"
            )

    def receiving(real: Callable) -> Callable:
        def receives(tensor, *args, **kwargs):
            if not getattr(inside, "depth", 0):
                same_dtype(tensor, getattr(real, "__name__", "recv"))
            return real(tensor, *args, **kwargs)

        return receives

    def counting(real: Callable) -> Callable:
        def sends(tensor, dst=None, *args, **kwargs):
            if getattr(inside, "depth", 0):
                return real(tensor, dst, *args, **kwargs)
            peer = dst if dst is not None else kwargs.get("group_dst")
            same_dtype(tensor, getattr(real, "__name__", "send"))
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                log.append((peer, tensor.numel() * tensor.element_size()))
            inside.depth = 1
            try:
                return real(tensor, dst, *args, **kwargs)
            finally:
                inside.depth = 0

        return sends

    # both names (_patching): P2POp accepts only c10d.isend, and batch_isend_irecv calls it
    wrappers = {"send": counting, "isend": counting, "recv": receiving, "irecv": receiving}
    with replaced(wrappers), library_collectives_forbidden():
        yield log


@contextlib.contextmanager
def collectives_called(dtype: torch.dtype | None = None) -> Iterator[list[str]]:
    """While a learner's code runs on a rank: the names of the collectives it calls, in order,
    torch.distributed's (``"all_reduce"``) and the course's own (``"collectives.ring_all_reduce"``,
    looked up in :mod:`dpcourse.collectives` when called), for a check of what the statement
    asks (one collective for SyncBatchNorm's statistics; a reduce-scatter, not an all-reduce
    and a slice, for ZeRO). With ``dtype``, torch.distributed's collectives given floating-point
    tensors of another dtype raise ``TypeError`` first: ranks whose tensors differ in size
    would otherwise pair them (gloo aborts the process)."""
    calls: list[str] = []
    inside = threading.local()  # a collective that calls another by name: count the outer one

    def counting(name: str) -> Callable[[Callable], Callable]:
        def wrap(real: Callable) -> Callable:
            def counted(*args, **kwargs):
                if getattr(inside, "depth", 0):
                    return real(*args, **kwargs)
                if dtype is not None and "." not in name:
                    for t in tensors_in_args(args, kwargs):
                        if t.is_floating_point() and t.dtype != dtype:
                            raise TypeError(
                                f"dist.{name} of a {t.dtype} tensor, while the tensors are "
                                f"{dtype}: the ranks' messages would not match (gloo aborts "
                                "the process). Make buffers like the tensor: t.new_empty(n), "
                                "torch.empty_like(t), or dtype=t.dtype, device=t.device")
                calls.append(name)
                inside.depth = 1
                try:
                    return real(*args, **kwargs)
                finally:
                    inside.depth = 0

            return counted

        return wrap

    saved = [(name, getattr(ours, name)) for name in COURSE_COLLECTIVES]
    try:
        for name, real in saved:
            setattr(ours, name, counting(f"collectives.{name}")(real))
        with replaced({name: counting(name) for name in (*LIBRARY_COLLECTIVES, "gather",
                                                             "scatter")}):
            yield calls
    finally:
        for name, real in saved:
            setattr(ours, name, real)


# The course's collectives (chapters 5 and 6) a learner may call by name
COURSE_COLLECTIVES = ("linear_broadcast", "naive_all_reduce", "tree_broadcast", "tree_reduce",
                      "tree_all_reduce", "ring_reduce_scatter", "ring_all_gather",
                      "ring_all_reduce", "ring_all_reduce_posted_ahead")


def call_collective(fn: Callable, *args: Any) -> tuple[Any, list[tuple[int, int]] | None]:
    """Run the learner's collective ``fn(*args)`` on this rank under :func:`learner_messages`:
    ``(what it returned, the messages it sent)``, or ``(None, None)`` if it called one of
    torch.distributed's own collectives (which the exercise is to build from messages)."""
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
    try:
        with learner_messages(dtype) as sent:
            returned = _call(fn, args, {}, clone=False)
    except AssertionError as exc:
        if "library collective" not in str(exc):
            raise
        return None, None
    return returned, sent


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (for rank-side checks, so that all
    ranks stop at the same case instead of some waiting for the others forever)."""


    # on the rank's device: NCCL (a GPU per rank) takes no CPU tensors
    t = torch.tensor([1.0 if flag else 0.0], device=runtime.device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def expect_equal(got: Any, want: Any, what: str) -> None:
    """Raise :class:`Mismatch` unless ``got == want`` (tensors: same shape, dtype and values)."""
    if isinstance(want, torch.Tensor):
        expect_close(got, want, what, rtol=0.0, atol=0.0)
        return
    if got != want:
        raise Mismatch(f"{what}: expected {_describe(want)}, got {_describe(got)}")


def expect_close(
    got: Any, want: torch.Tensor, what: str, rtol: float | None = None, atol: float | None = None
) -> None:
    """Raise :class:`Mismatch` naming ``what`` unless ``got`` is a tensor close to ``want``.

    Tolerances default to torch.testing's for the dtype (float32: rtol 1.3e-6, atol 1e-5).
    """
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: expected a tensor, got {type(got).__name__} {_describe(got)}")
    if got.shape != want.shape:
        raise Mismatch(f"{what}: expected shape {tuple(want.shape)}, got shape {tuple(got.shape)}")
    if got.dtype != want.dtype:
        raise Mismatch(f"{what}: expected dtype {want.dtype}, got {got.dtype}")
    try:
        torch.testing.assert_close(
            got.detach().cpu(), want.detach().cpu(), rtol=rtol, atol=atol, equal_nan=True
        )
    except AssertionError:
        diff = (got.detach().cpu().double() - want.detach().cpu().double()).abs()
        i = int(diff.argmax())
        index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), want.shape))
        ratio = ""
        flat_want, flat_got = want.detach().cpu().reshape(-1), got.detach().cpu().reshape(-1)
        if flat_want[i] != 0:
            ratio = f" (got/expected = {float(flat_got[i]) / float(flat_want[i]):.4g})"
        raise Mismatch(
            f"{what}: {int((diff > 0).sum())} of {want.numel()} values differ; the largest "
            f"difference is at index {index}: expected {float(flat_want[i]):.6g}, "
            f"got {float(flat_got[i]):.6g}{ratio}"
        ) from None


# ---------------------------------------------------------------------------------- results
def run_check(label: str, fn: Any) -> CheckResult:
    """Run the check of exercise ``label`` on ``fn`` and return its result (never raises, but
    for a label no exercise has: a ``KeyError`` that lists them)."""
    if label not in registry():
        raise KeyError(f"no exercise is labelled {label!r}; the labels with checks are "
                       f"{', '.join(registry())}")
    ex = registry()[label]
    if not callable(fn):
        return CheckResult(
            label, ex.name, "failed", f"expected your function, got {type(fn).__name__}"
        )
    try:
        with _time_limit(ex.timeout):
            message = ex.check(fn)
        return CheckResult(label, ex.name, "passed", message or "")
    except NotAttempted as exc:
        return not_attempted(label, str(exc))
    except Mismatch as exc:
        return CheckResult(label, ex.name, "failed", str(exc))
    except CheckTimeout as exc:
        return CheckResult(
            label,
            ex.name,
            "failed",
            f"your code timed out: {exc}. Look for a loop that never ends.",
        )
    except Exception as exc:  # a bug in the check itself must not look like the learner's fault
        return CheckResult(
            label,
            ex.name,
            "error",
            f"the check itself failed ({type(exc).__name__}: {exc}); please report it",
        )


def not_attempted(label: str, reason: str) -> CheckResult:
    """What the check of ``label`` says of a function that is not written yet: ``reason`` is its
    ``NotImplementedError``'s message (the student edition shows this without running it)."""
    return CheckResult(
        label,
        registry()[label].name,
        "not attempted",
        f"{reason}. Write the function, run its cell, then run this check again.",
    )


def _show(result: CheckResult) -> None:
    try:
        # import here: optional, absent outside Jupyter
        from IPython import get_ipython  # noqa: PLC0415
        from IPython.display import HTML, display  # noqa: PLC0415

        if get_ipython() is not None:
            display(HTML(result.html()))  # the student edition writes the same: display_output
            return
    except ImportError:
        pass
    print(result.text())


def log_result(result: CheckResult) -> None:
    """Append ``result`` as a JSON line to the file ``LOG_ENV`` names (grading reads it)."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(result)) + "\n")


class ExerciseFailed(AssertionError):
    """Raised by a check only in the strict (reference) build, where every check must pass."""


class _Checks:
    """``check.<name>(fn)``: run the check called ``name`` on the learner's ``fn`` and show the
    result (a green tick, or a red cross with the reason). It never raises in a learner's
    notebook, so the cells below still run."""

    def __getattr__(self, name: str) -> Callable[[Any], None]:
        matches = [ex for ex in registry().values() if ex.name == name]
        if not matches:
            names = ", ".join(sorted(ex.name for ex in registry().values()))
            raise AttributeError(f"there is no check called {name!r}; the checks are: {names}")
        ex = matches[0]

        def run(fn: Any) -> None:
            result = run_check(ex.label, fn)
            _show(result)  # shown here, not returned, so that it appears exactly once
            log_result(result)
            if os.environ.get(STRICT_ENV) and not result.passed:
                raise ExerciseFailed(result.text())

        run.__doc__ = ex.check.__doc__
        run.__name__ = name
        return run

    def __dir__(self) -> list[str]:
        return sorted(ex.name for ex in registry().values())


check = _Checks()
