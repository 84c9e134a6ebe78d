"""A job: what travels from the caller to each rank and back.

The caller packs ``fn(*args, **kwargs)`` with :func:`serialise`: the function and its arguments
by value (cloudpickle, so that a function defined in a notebook cell or a script's ``__main__``
travels), the caller's ``sys.path`` (so that what it imported from its own modules imports on
the rank) and the source lines of notebook cells (so that tracebacks show the code). The rank
runs it with :func:`run_job`, whose reply is ``("result", bytes)`` or, from
:func:`error_reply`, ``("error", type name, message, traceback, pickled exception or None)``.
Tensors in the result travel back on the CPU (:class:`_HostPickler`), so that the caller can
compare and plot what ranks on different GPUs returned, as on a machine without GPUs.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
import sys
import traceback
from collections.abc import Callable

import cloudpickle
import torch

from dpcourse.harness import device_audit


# ------------------------------------------------------------------------- the caller's side
def _cell_sources(fn: Callable) -> dict[str, list[str]]:
    """Source lines that a rank cannot read from disk: notebook cells and the like."""
    wanted = {getattr(getattr(fn, "__code__", None), "co_filename", None)}
    sources: dict[str, list[str]] = {}
    total = 0
    for name, entry in list(linecache.cache.items()):
        if len(entry) != 4 or not entry[2] or os.path.exists(name):
            continue
        if name in wanted or "ipykernel_" in name or name.startswith("<ipython-input"):
            total += entry[0] or 0
            if total > 4_000_000:
                break
            sources[name] = list(entry[2])
    return sources


def serialise(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """The job a rank runs, packed for :mod:`dpcourse.harness.launch.worker`; a ``TypeError`` that
    says
    what to pass instead when ``fn`` or its arguments cannot travel."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, the function each rank runs; got "
                        f"{type(fn).__name__}: pass the function itself, not what calling it "
                        "returns")
    sys_path = [p for p in sys.path if p and os.path.isdir(p)]
    try:
        job = cloudpickle.dumps((fn, args, kwargs))
        return pickle.dumps((sys_path, _cell_sources(fn), job))
    except Exception as exc:
        raise TypeError(
            f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{exc}. "
            "Pass plain data (tensors, numbers, lists, dicts) and create anything else "
            "(open files, locks, process groups, CUDA streams) inside the function."
        ) from exc


# ---------------------------------------------------------------------------- the rank's side
class _HostPickler(cloudpickle.Pickler):
    """cloudpickle, with every tensor on a GPU (or on the device audit's stand-in for one) sent
    as a CPU copy: rank 1's ``cuda:1`` tensor would otherwise arrive on ``cuda:1`` in the caller
    and fail to meet rank 0's, or the caller's CPU tensors."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (
            obj.device.type != "cpu" or device_audit.where(obj) == "device"
        ):
            host = obj.detach().cpu()
            device_audit.tag(host, "host")
            host.requires_grad_(obj.requires_grad)
            return host.__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def host_dumps(obj) -> bytes:
    """Pickle a rank's result with :class:`_HostPickler`."""
    buffer = io.BytesIO()
    _HostPickler(buffer).dump(obj)
    return buffer.getvalue()


def error_reply(exc: BaseException, skip_frames: int) -> tuple:
    tb = exc.__traceback__
    for _ in range(skip_frames):  # hide the worker's own frames: the learner's code comes first
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        original = cloudpickle.dumps(exc)
    except Exception:
        original = None
    return ("error", type(exc).__name__, str(exc), text, original)


def run_job(payload: bytes) -> tuple:
    # The caller's sys.path comes first, so that functions it imported from its own modules
    # (pickled by reference) import here too.
    sys_path, sources, job = pickle.loads(payload)
    for entry in sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    # Source lines of notebook cells, so that tracebacks show the code; mtime None keeps
    # linecache.checkcache from dropping entries whose file does not exist here.
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    try:
        fn, args, kwargs = cloudpickle.loads(job)
    except BaseException as exc:
        exc.add_note("(while unpacking the function and arguments sent to this rank)")
        return error_reply(exc, 0)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return error_reply(exc, 1)
    try:
        return ("result", host_dumps(result))
    except BaseException as exc:
        exc.add_note("(the function returned, but its result could not be sent back to the caller)")
        return error_reply(exc, 0)
