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
  (cloudpickle), and the ranks never re-import the caller (they are forked from a server
  process that has imported torch and nothing of the caller's);
* the rendezvous store is hosted by the caller on a port the OS picks, so runs never collide;
* what a rank prints appears in the caller, prefixed ``[rank r]``;
* an exception in a rank is raised in the caller as :class:`RankError`, naming the rank, with its
  traceback (source lines of notebook cells included);
* a rank that dies raises :class:`RankDiedError`, one that stalls past ``timeout`` raises
  :class:`RankTimeoutError` with the stack it was stuck in; either way every rank is killed;
* ranks end by leaving the process group and exiting at once, without a crash in teardown.

Starting ranks is cheap once the caller's fork server is running (its first start imports
torch, about 2 s): 0.12 s for 2 ranks and 0.19 s for 4 on the course's 2-core machine, where
fresh interpreters take 2.5 and 4.7 s (``python -m dpcourse.harness.bench launch`` measures both). A
:class:`RankPool` keeps ranks alive between runs (a run on it costs about a millisecond); while
one is open, :func:`run_ranks` with the same world size and backend uses it::

    with RankPool(4):
        run_ranks(work, 4)      # no start-up cost after the first

With the environment variable ``DPCOURSE_KEEP_RANKS=K``, :func:`run_ranks` itself keeps the
ranks it starts open for later calls of the same size, up to ``K`` world sizes (the oldest is
closed first), until the interpreter exits. ``make notebooks`` sets it, so that the test run
starts each world size's ranks once per notebook instead of at every cell. No result depends
on it: torch seeds every fresh process at random, so code that needs the same numbers on every
run seeds them itself (the chapters do), in fresh and in kept ranks alike.

One run, in the order the code takes it (each step one module of this folder):

1. :func:`run_ranks` finds or starts a :class:`RankPool` (here), which chooses the backend once,
   with :func:`dpcourse.runtime.choose_backend` (on an emulated cluster: gloo);
2. :class:`~dpcourse.harness.launch.process.RankProcesses` hosts the rendezvous store and starts
   ``world_size`` processes, each told its rank, the backend and the store in its environment;
3. :mod:`~dpcourse.harness.launch.forkserver` forks each from a server that has imported torch
   (or starts a fresh interpreter);
4. :mod:`~dpcourse.harness.launch.worker`, in the rank, joins the process group with
   :func:`dpcourse.runtime.init_process_group`, which picks the rank's device
   (:func:`dpcourse.runtime.device_for_rank`), then runs the jobs that
   :mod:`~dpcourse.harness.launch.job` packs and unpacks;
5. :mod:`~dpcourse.harness.launch.errors` turns a rank's failure into the caller's exception.

:func:`run_torchrun` runs a script or module under ``torchrun`` in a subprocess (tests, chapter
8's trainer), and :func:`run_torchrun_on_cluster` one torchrun agent per node of an emulated
cluster (chapter 8); there torchrun starts the ranks and the same
:func:`dpcourse.runtime.init_process_group` chooses their backend and device.

Chapter 0: the course-wide launcher.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from dpcourse import runtime
from dpcourse.harness import device_audit
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.harness.launch.job import serialise
from dpcourse.harness.launch.process import RankProcesses
from dpcourse.harness.launch.torchrun import TorchrunAgents, run_torchrun, run_torchrun_on_cluster

__all__ = [
    "run_ranks",
    "RankPool",
    "RankError",
    "RankDiedError",
    "RankTimeoutError",
    "run_torchrun",
    "run_torchrun_on_cluster",
    "TorchrunAgents",
]

DEFAULT_TIMEOUT = 120.0
_DEFAULT_START_TIMEOUT = 90.0


# ---------------------------------------------------------------------------------------- pool
_open_pools: list[RankPool] = []
_open_pools_lock = threading.Lock()


def _check_arguments(world_size: int, backend: str, cluster=None) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the number of ranks), got "
                         f"{world_size!r}")
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'auto', 'gloo', 'nccl' or 'mpi', got {backend!r}")
    if cluster is not None and not isinstance(cluster, EmulatedCluster):
        raise TypeError(
            "cluster must be an EmulatedCluster, started (`with EmulatedCluster(nodes=2) as "
            f"cluster: run_ranks(fn, 2, cluster=cluster)`), or None; got {cluster!r}"
        )


def _check_seconds(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")


def _check_function(fn: Callable, world_size: object) -> None:
    if callable(fn):
        return
    if callable(world_size) and isinstance(fn, int):
        raise TypeError(f"the function comes first: run_ranks(fn, world_size), not "
                        f"run_ranks({fn!r}, fn)")
    raise TypeError(
        f"fn must be callable, the function each rank runs; got {type(fn).__name__}: pass "
        "the function itself, run_ranks(work, 2), not what calling it returns, "
        "run_ranks(work(), 2)"
    )


def _pool_backend(world_size: int, backend: str, cluster) -> str:
    """The backend a pool of ``world_size`` ranks uses (on an emulated cluster: gloo, whose
    traffic goes through the nodes' network interfaces)."""
    if cluster is None:
        return runtime.choose_backend(world_size) if backend == "auto" else backend
    cluster.check_world_size(world_size)
    if backend not in ("auto", "gloo"):
        raise ValueError(
            f"backend={backend!r} on an emulated cluster: its links carry gloo's traffic only "
            "(NCCL would bypass them); use backend='gloo' or 'auto'"
        )
    return "gloo"


class RankPool:
    """``world_size`` ranks kept alive between runs, with the default process group initialised.

    Use it as a context manager (or call :meth:`start` and :meth:`close`). Within the ``with``
    block, :func:`run_ranks` calls with the same world size and backend run on this pool. After a
    run fails (an exception, a dead rank, a timeout) the pool kills its ranks and starts fresh
    ones on the next run, since a failed collective can leave the process group unusable.

    ``threads`` is the intra-op thread count of each rank (1 keeps N ranks from fighting over the
    cores); ``prefix_output`` marks each line a rank prints with ``[rank r]``. With ``cluster``
    (a started :class:`dpcourse.harness.cluster.EmulatedCluster` of ``world_size`` ranks) each rank
    runs inside its node's network namespace, over gloo; the pool closes with the cluster.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        *,
        threads: int = 1,
        start_timeout: float = _DEFAULT_START_TIMEOUT,
        prefix_output: bool = True,
        cluster=None,
    ):
        _check_arguments(world_size, backend, cluster)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads must be an int from 0 (torch's default) up: the intra-op "
                             f"threads of each rank; got {threads!r}")
        _check_seconds(start_timeout, "start_timeout")
        self.world_size = world_size
        self.cluster = cluster
        self.backend = _pool_backend(world_size, backend, cluster)
        self.audit = device_audit.setting()  # the machine the device audit models, if any
        if self.backend == "nccl":
            runtime.device_for_rank(0, world_size, "nccl")  # clear error if GPUs are missing
        self.threads = threads
        self.start_timeout = start_timeout
        self.prefix_output = prefix_output
        self._procs: RankProcesses | None = None
        self._lock = threading.Lock()
        self._registered = False

    # -- life cycle -------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._procs is not None

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks, in rank order (empty when not started)."""
        return [r.proc.pid for r in self._procs.ranks] if self._procs else []

    def start(self, lazy: bool = False) -> RankPool:
        """Start the ranks (if not running) and wait until every one has joined the group.

        With ``lazy=True`` the pool opens (so :func:`run_ranks` uses it) but its ranks start at
        its first run: a test session opens pools of several sizes and pays only for those used.
        """
        with self._lock:
            if not self._registered:
                with _open_pools_lock:
                    _open_pools.append(self)
                if self.cluster is not None:
                    self.cluster._pools.append(self)  # closed when the cluster closes
                self._registered = True
            if self._procs is None and not lazy:
                self._spawn()
        return self

    def close(self) -> None:
        """Stop the ranks: each leaves the process group and exits; stragglers are killed."""
        with self._lock:
            if self._procs is not None:
                procs, self._procs = self._procs, None
                procs.stop()
            if self._registered:
                with _open_pools_lock:
                    if self in _open_pools:
                        _open_pools.remove(self)
                if self.cluster is not None and self in self.cluster._pools:
                    self.cluster._pools.remove(self)
                self._registered = False

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pids={self.pids}" if self._procs else "not started"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running ----------------------------------------------------------------------------
    def run(
        self, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds) bounds the run itself; starting the ranks, where needed, has its
        own ``start_timeout``.
        """
        _check_function(fn, None)
        _check_seconds(timeout, "timeout")
        return self._run_payload(serialise(fn, args, kwargs), timeout)

    def _run_payload(self, payload: bytes, timeout: float) -> list:
        with self._lock:
            if self._procs is None:
                self._spawn()
            started = time.monotonic()
            try:
                self._procs.send(("run", payload))
                replies = self._procs.collect(started + timeout, timeout)
            except BaseException as exc:
                # A failed run (or Ctrl-C) can leave ranks inside a collective: start afresh.
                self._kill_ranks()
                if self.cluster is not None and isinstance(exc, RankError):
                    self.cluster.explain(exc, started)  # the faults it injected, if any
                raise
        return [cloudpickle.loads(replies[i][1]) for i in range(self.world_size)]

    def _spawn(self) -> None:
        if self.cluster is not None:
            self.cluster.check_ready()  # a node cut off could not join: say so at once
        procs = RankProcesses(
            self.world_size,
            self.backend,
            self.threads,
            self.start_timeout,
            self.prefix_output,
            self.cluster,
        )
        procs.start()  # kills what it started if the ranks do not all join
        self._procs = procs

    def _kill_ranks(self) -> None:
        if self._procs is not None:
            procs, self._procs = self._procs, None
            procs.kill()


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    cluster=None,
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
    call alone (or kept for the next call, under ``DPCOURSE_KEEP_RANKS``: see the module's
    docstring). ``cluster``: run the ranks on the nodes of a started
    :class:`dpcourse.harness.cluster.EmulatedCluster` (node-major; ``world_size`` must fill it).
    Used in every multi-process chapter (5 onwards) and by the tests.
    """
    _check_function(fn, world_size)
    _check_arguments(world_size, backend, cluster)  # before looking for a pool: 2.0 is none
    _check_seconds(timeout, "timeout")
    pool_backend = _pool_backend(world_size, backend, cluster)
    with _open_pools_lock:
        pool = next(
            (
                p
                for p in reversed(_open_pools)
                if p.world_size == world_size
                and p.backend == pool_backend
                and p.cluster is cluster
                and p.audit == device_audit.setting()
            ),
            None,
        )
    if pool is not None:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
    payload = serialise(fn, args, kwargs)  # fails on unpicklable input before any start-up
    pool = RankPool(world_size, backend, cluster=cluster)
    if _kept_pools_limit() > 0:
        _keep(pool)
        return pool._run_payload(payload, timeout)
    try:
        return pool._run_payload(payload, timeout)
    finally:
        pool.close()


# Pools that run_ranks keeps open under DPCOURSE_KEEP_RANKS, oldest first.
_kept_pools: list[RankPool] = []


def _kept_pools_limit() -> int:
    value = os.environ.get("DPCOURSE_KEEP_RANKS", "0")
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(
            f"DPCOURSE_KEEP_RANKS must be a number of pools (0 to keep none), got {value!r}"
        ) from None


def _keep(pool: RankPool) -> None:
    """Open ``pool`` for later run_ranks calls; close the oldest kept pools beyond the limit."""
    pool.start(lazy=True)
    _kept_pools.append(pool)
    while len(_kept_pools) > _kept_pools_limit():
        _kept_pools.pop(0).close()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_open_pools):
        try:
            pool._kill_ranks()
        except Exception:
            pass
