"""Run a function on N ranks, from a notebook or a script, and get each rank's result back.

Every multi-process cell of the course goes through :func:`run_ranks`::

    def work():
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t.item()

    run_ranks(work, 4)          # -> [10.0, 10.0, 10.0, 10.0]

What it guarantees (each is a test in ``tests/test_launch.py``):

* ``fn`` may be defined in a notebook cell or a script's ``__main__``: it travels by value
  (cloudpickle), and the ranks are fresh interpreters that never re-import the caller;
* the rendezvous store is hosted by the caller on a port the OS picks, so runs never collide;
* what a rank prints appears in the caller, prefixed ``[rank r]``;
* an exception in a rank is raised in the caller as :class:`RankError`, naming the rank, with its
  traceback (source lines of notebook cells included);
* a rank that dies raises :class:`RankDiedError`, one that stalls past ``timeout`` raises
  :class:`RankTimeoutError` with the stack it was stuck in; either way every rank is killed;
* ranks end by leaving the process group and exiting at once, without a crash in teardown.

Starting ranks costs about a second (``python -m dpcourse.bench launch`` measures it). A
:class:`RankPool` keeps ranks alive between runs; while one is open, :func:`run_ranks` with the
same world size and backend uses it::

    with RankPool(4):
        run_ranks(work, 4)      # no start-up cost after the first
"""

from __future__ import annotations

import atexit
import linecache
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from dpcourse import runtime
from dpcourse.rank_errors import (
    RankDiedError,
    RankError,
    RankTimeoutError,
    annotate_stack,
    learner_stack,
    signal_name,
)

__all__ = ["run_ranks", "RankPool", "RankError", "RankDiedError", "RankTimeoutError"]

DEFAULT_TIMEOUT = 120.0
DEFAULT_START_TIMEOUT = 90.0
# After the first rank fails, how long the others get to report their own errors before they are
# killed (ranks waiting in a collective for the failed one usually fail within milliseconds).
FAILURE_GRACE = 1.0


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


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    out: int  # read ends of the rank's stdout and stderr pipes (-1 once closed)
    err: int
    stack_file: str
    tail: deque  # last lines the rank wrote to stderr, for RankDiedError


# ---------------------------------------------------------------------------------------- pool
_open_pools: list[RankPool] = []
_open_pools_lock = threading.Lock()


class RankPool:
    """``world_size`` ranks kept alive between runs, with the default process group initialised.

    Use it as a context manager (or call :meth:`start` and :meth:`close`). Within the ``with``
    block, :func:`run_ranks` calls with the same world size and backend run on this pool. After a
    run fails (an exception, a dead rank, a timeout) the pool kills its ranks and starts fresh
    ones on the next run, since a failed collective can leave the process group unusable.

    ``threads`` is the intra-op thread count of each rank (1 keeps N ranks from fighting over the
    cores); ``prefix_output`` marks each line a rank prints with ``[rank r]``.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        *,
        threads: int = 1,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        prefix_output: bool = True,
    ):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in ("auto", "gloo", "nccl", "mpi"):
            raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or 'mpi', got {backend!r}")
        self.world_size = world_size
        self.backend = runtime.choose_backend(world_size) if backend == "auto" else backend
        if self.backend == "nccl":
            runtime.device_for_rank(0, world_size, "nccl")  # clear error if GPUs are missing
        self.threads = threads
        self.start_timeout = start_timeout
        self.prefix_output = prefix_output
        self._ranks: list[_Rank] = []
        self._store = None
        self._tmpdir: str | None = None
        self._lock = threading.Lock()
        self._registered = False
        self._partial: dict[int, bytes] = {}  # rank -> bytes of an unfinished output line

    # -- life cycle -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return bool(self._ranks)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks, in rank order (empty when not started)."""
        return [r.proc.pid for r in self._ranks]

    def start(self) -> RankPool:
        """Start the ranks (if not running) and wait until every one has joined the group."""
        with self._lock:
            if not self._registered:
                with _open_pools_lock:
                    _open_pools.append(self)
                self._registered = True
            if not self._ranks:
                self._spawn()
        return self

    def close(self) -> None:
        """Stop the ranks: each leaves the process group and exits; stragglers are killed."""
        with self._lock:
            self._stop_ranks()
            if self._registered:
                with _open_pools_lock:
                    if self in _open_pools:
                        _open_pools.remove(self)
                self._registered = False

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pids={self.pids}" if self._ranks else "not started"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running ----------------------------------------------------------------------------
    def run(
        self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds) bounds the run itself; starting the ranks, where needed, has its
        own ``start_timeout``.
        """
        return self._run_payload(_serialise(fn, args, kwargs), timeout)

    def _run_payload(self, payload: bytes, timeout: float) -> list:
        with self._lock:
            if not self._ranks:
                self._spawn()
            try:
                for r in self._ranks:
                    r.conn.send(("run", payload))
                replies = self._collect(time.monotonic() + timeout, timeout)
            except BaseException:
                # A failed run (or Ctrl-C) can leave ranks inside a collective: start afresh.
                self._kill_ranks()
                raise
        return [cloudpickle.loads(replies[i][1]) for i in range(self.world_size)]

    # -- internals --------------------------------------------------------------------------
    def _spawn(self) -> None:
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore(
            "127.0.0.1",
            0,  # the OS picks a free port, and we hold it for the pool's whole life
            is_master=True,
            timeout=datetime.timedelta(seconds=self.start_timeout),
            wait_for_workers=False,
        )
        self._tmpdir = tempfile.mkdtemp(prefix="dpcourse-ranks-")
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(runtime.__file__)))
        pythonpath = os.pathsep.join(
            [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        base_env = dict(
            os.environ,
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self._store.port),
            PYTHONPATH=pythonpath,
            PYTHONUNBUFFERED="1",
            MPLBACKEND="Agg",
            DPCOURSE_BACKEND=self.backend,
            DPCOURSE_THREADS=str(self.threads),
            DPCOURSE_START_TIMEOUT=str(self.start_timeout),
            DPCOURSE_PARENT_PID=str(os.getpid()),
        )
        if self.threads > 0:
            base_env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        try:
            for rank in range(self.world_size):
                ours, theirs = socket.socketpair()
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                stack_file = os.path.join(self._tmpdir, f"stack-{rank}.txt")
                env = dict(
                    base_env, RANK=str(rank), LOCAL_RANK=str(rank), DPCOURSE_STACK_FILE=stack_file
                )
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "dpcourse._worker", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        stdout=out_w,
                        stderr=err_w,
                        env=env,
                        start_new_session=True,  # its own process group: one killpg ends it all
                    )
                finally:
                    theirs.close()
                    os.close(out_w)
                    os.close(err_w)
                self._ranks.append(
                    _Rank(
                        rank,
                        proc,
                        Connection(ours.detach()),
                        out_r,
                        err_r,
                        stack_file,
                        deque(maxlen=40),
                    )
                )
            self._collect(time.monotonic() + self.start_timeout, self.start_timeout, starting=True)
        except BaseException:
            self._kill_ranks()
            raise

    def _forward(self, rank: _Rank, fd: int) -> bool:
        """Copy what a rank wrote to the caller's stdout/stderr; False at end of file."""
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        is_err = fd == rank.err
        if not data:
            os.close(fd)
            if is_err:
                rank.err = -1
            else:
                rank.out = -1
            rest = self._partial.pop((rank.rank, is_err), b"")
            if rest:
                self._emit(rank, is_err, rest + b"\n")
            return False
        key = (rank.rank, is_err)
        buf = self._partial.pop(key, b"") + data
        head, sep, tail = buf.rpartition(b"\n")
        if sep:
            self._emit(rank, is_err, head + b"\n")
        if tail:
            self._partial[key] = tail
        return True

    def _emit(self, rank: _Rank, is_err: bool, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        lines = text.splitlines()
        if is_err:
            rank.tail.extend(lines)
        if self.prefix_output:
            text = "".join(f"[rank {rank.rank}] {line}\n" for line in lines)
        stream = sys.stderr if is_err else sys.stdout
        stream.write(text)
        stream.flush()

    def _drain(self, wait_s: float = 0.0) -> None:
        """Forward whatever output the ranks have written so far."""
        deadline = time.monotonic() + wait_s
        while True:
            fds = {fd: r for r in self._ranks for fd in (r.out, r.err) if fd >= 0}
            if not fds:
                return
            ready = wait(list(fds), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            for fd in ready:
                self._forward(fds[fd], fd)

    def _collect(self, deadline: float, timeout: float, starting: bool = False) -> dict[int, tuple]:
        """Wait for one reply from every rank, forwarding output meanwhile; raise on failure."""
        replies: dict[int, tuple] = {}
        failures: list[tuple[int, RankError]] = []
        by_conn = {r.conn: r for r in self._ranks}
        grace_started = False
        while len(replies) + len(failures) < self.world_size:
            failed = {r for r, _ in failures}
            waiting = [r for r in self._ranks if r.rank not in replies and r.rank not in failed]
            now = time.monotonic()
            if now >= deadline:
                if failures:
                    break
                raise self._timeout_error([r.rank for r in waiting], timeout, starting)
            handles: list = [r.conn for r in waiting]
            fds = {fd: r for r in self._ranks for fd in (r.out, r.err) if fd >= 0}
            ready = wait(handles + list(fds), timeout=min(deadline - now, 0.5))
            for obj in ready:
                if isinstance(obj, int):
                    r = fds[obj]
                    # A death error earlier in this loop may have drained and closed this fd
                    # (its number may even be reused by now): forward only if it is still open.
                    if obj in (r.out, r.err):
                        self._forward(r, obj)
                    continue
                rank = by_conn[obj]
                try:
                    reply = obj.recv()
                except (EOFError, OSError):
                    failures.append((rank.rank, self._death_error(rank, starting)))
                else:
                    if reply[0] == "error":
                        failures.append((rank.rank, self._rank_error(rank.rank, reply, starting)))
                    else:
                        replies[rank.rank] = reply
                if failures and not grace_started:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                    grace_started = True
        self._drain()
        if failures:
            first = failures[0][1]
            first.others.extend(f"rank {r}: {e.summary.splitlines()[0]}" for r, e in failures[1:])
            done = set(replies) | {r for r, _ in failures}
            unfinished = [r.rank for r in self._ranks if r.rank not in done]
            if unfinished:
                first.others.append(f"ranks {unfinished} were still running and were killed")
            raise first
        return replies

    def _rank_error(self, rank: int, reply: tuple, starting: bool) -> RankError:
        _, type_name, message, text, original = reply
        try:
            exc = cloudpickle.loads(original) if original is not None else None
        except Exception:
            exc = None
        where = "while joining the process group: " if starting else ""
        summary = f"raised {where}{type_name}: {message}".rstrip(": ")
        return RankError(rank, self.world_size, summary, text, exc)

    def _death_error(self, rank: _Rank, starting: bool) -> RankDiedError:
        try:
            code = rank.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._drain(0.2)
        if code is None:
            how = "closed its connection to the launcher"
        elif code < 0:
            how = f"was killed by {signal_name(code)}"
            if code == -signal.SIGKILL:
                how += " (the machine may have run out of memory, or someone killed it)"
        else:
            how = f"exited with code {code} without returning a result"
        when = "while starting" if starting else "during the run"
        summary = f"died {when}: its process {how}."
        tail = "\n".join(rank.tail)
        text = f"last lines it wrote to stderr:\n{tail}" if tail else ""
        return RankDiedError(rank.rank, self.world_size, summary, text)

    def _timeout_error(
        self, stalled: list[int], timeout: float, starting: bool
    ) -> RankTimeoutError:
        stacks: dict[int, str] = {}
        for r in self._ranks:
            if r.rank in stalled and r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, signal.SIGUSR1)  # faulthandler dumps the rank's stack
                except ProcessLookupError:
                    pass
        time.sleep(0.3)
        for r in self._ranks:
            if r.rank in stalled:
                try:
                    with open(r.stack_file) as f:
                        stacks[r.rank] = annotate_stack(learner_stack(f.read()))
                except OSError:
                    pass
        return RankTimeoutError(stalled, self.world_size, timeout, stacks, starting)

    def _stop_ranks(self) -> None:
        if not self._ranks:
            return
        for r in self._ranks:
            try:
                r.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 15
        for r in self._ranks:
            while r.proc.poll() is None and time.monotonic() < deadline:
                self._drain(0.05)
        self._drain()
        codes = {r.rank: r.proc.poll() for r in self._ranks}
        self._kill_ranks()
        bad = {rank: code for rank, code in codes.items() if code != 0}
        if bad:
            warnings.warn(
                "ranks did not shut down cleanly after their work was done: "
                + ", ".join(
                    f"rank {r}: "
                    + (
                        "still running, killed"
                        if c is None
                        else signal_name(c)
                        if c < 0
                        else f"exit code {c}"
                    )
                    for r, c in bad.items()
                ),
                RuntimeWarning,
                stacklevel=3,
            )

    def _kill_ranks(self) -> None:
        for r in self._ranks:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    r.proc.kill()
        for r in self._ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
                pass
            r.conn.close()
            for fd in (r.out, r.err):
                if fd >= 0:
                    os.close(fd)
        self._ranks = []
        self._partial.clear()
        self._store = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def _serialise(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
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


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    Each rank is a separate process with the default process group initialised (``backend``
    ``"auto"`` picks NCCL when every rank has a GPU of its own, else gloo; see
    :func:`dpcourse.runtime.choose_backend`), so ``fn`` can call ``torch.distributed`` directly
    and find its device with :func:`dpcourse.runtime.device`. Arguments and results travel by
    pickle: pass and return plain data and tensors (CPU tensors are cheapest).

    Raises :class:`RankError` if a rank raises, :class:`RankDiedError` if one dies and
    :class:`RankTimeoutError` if the run takes longer than ``timeout`` seconds (start-up not
    counted); no rank outlives a failed run. If a :class:`RankPool` with the same world size and
    backend is open, the run uses its ranks; otherwise ranks are started and stopped for this
    call alone. Used in every multi-process chapter (5 onwards) and by the tests.
    """
    pool_backend = runtime.choose_backend(world_size) if backend == "auto" else backend
    with _open_pools_lock:
        pool = next(
            (
                p
                for p in reversed(_open_pools)
                if p.world_size == world_size and p.backend == pool_backend
            ),
            None,
        )
    if pool is not None:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    payload = _serialise(fn, args, kwargs)  # fails on unpicklable input before any start-up
    pool = RankPool(world_size, backend)
    try:
        return pool._run_payload(payload, timeout)
    finally:
        pool.close()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        try:
            pool._kill_ranks()
        except Exception:
            pass
