"""The rank processes behind :class:`dpcourse.harness.launch.RankPool`: starting, output, failures.

:class:`RankProcesses` starts ``world_size`` ranks running :mod:`dpcourse.harness.launch.worker`
(forked from a server that has imported torch, or fresh interpreters: see
:mod:`dpcourse.harness.launch.forkserver`; each in a session of its own, joined to a ``TCPStore``
that the caller hosts on a port the OS picks), forwards what they print with a ``[rank r]`` prefix,
waits for one reply from each, and turns a rank that raised, died or stalled into the error of
:mod:`dpcourse.harness.launch.errors` (a stalled rank's stack is dumped by ``faulthandler`` on
``SIGUSR1``). What travels to a rank and back is :mod:`dpcourse.harness.launch.job`'s.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import cloudpickle
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.harness.launch.errors import (
    RankDiedError,
    RankError,
    RankTimeoutError,
    annotate_stack,
    learner_stack,
    signal_name,
)
from dpcourse.harness.launch.forkserver import ForkedRank, start_rank

# After the first rank fails, how long the others get to report their own errors before they are
# killed (ranks waiting in a collective for the failed one usually fail within milliseconds).
FAILURE_GRACE = 1.0
# A warning c10d prints for each connection from an address without a host name, as those of
# an EmulatedCluster's nodes are; dropped from the ranks' output on a cluster.
_UNNAMED_PEER = "The hostname of the client socket cannot be retrieved"


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen | ForkedRank
    conn: Connection
    out: int  # read ends of the rank's stdout and stderr pipes (-1 once closed)
    err: int
    stack_file: str
    tail: deque  # last lines the rank wrote to stderr, for RankDiedError


class RankProcesses:
    """``world_size`` rank processes and the caller's side of their pipes (see the module)."""

    def __init__(
        self,
        world_size: int,
        backend: str,
        threads: int,
        start_timeout: float,
        prefix_output: bool,
        cluster=None,
    ):
        self.world_size = world_size
        self.cluster = cluster  # an EmulatedCluster: each rank runs inside its node
        self.backend = backend
        self.threads = threads
        self.start_timeout = start_timeout
        self.prefix_output = prefix_output
        self.ranks: list[_Rank] = []
        self._store = None
        self._tmpdir: str | None = None
        self._partial: dict[tuple[int, bool], bytes] = {}  # bytes of an unfinished output line

    def start(self) -> None:
        """Start the ranks and wait until every one has joined the process group."""


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
        )
        if self.threads > 0:
            base_env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        node_environment = self.cluster.rank_environment if self.cluster else lambda rank: {
            "LOCAL_RANK": str(rank)}
        try:
            for rank in range(self.world_size):
                ours, theirs = socket.socketpair()
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                stack_file = os.path.join(self._tmpdir, f"stack-{rank}.txt")
                env = dict(base_env, RANK=str(rank), DPCOURSE_STACK_FILE=stack_file)
                env.update(node_environment(rank))
                try:
                    proc = start_rank(theirs.fileno(), out_w, err_w, env)
                finally:
                    theirs.close()
                    os.close(out_w)
                    os.close(err_w)
                self.ranks.append(
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
            self.collect(time.monotonic() + self.start_timeout, self.start_timeout, starting=True)
        except BaseException:
            self.kill()
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
        if self.cluster is not None:  # c10d cannot look up the emulated nodes' names: harmless
            lines = [line for line in lines if _UNNAMED_PEER not in line]
            text = "".join(line + "\n" for line in lines)
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
            fds = {fd: r for r in self.ranks for fd in (r.out, r.err) if fd >= 0}
            if not fds:
                return
            ready = wait(list(fds), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return
            for fd in ready:
                self._forward(fds[fd], fd)

    def send(self, message: tuple) -> None:
        for r in self.ranks:
            r.conn.send(message)

    def collect(self, deadline: float, timeout: float, starting: bool = False) -> dict[int, tuple]:
        """Wait for one reply from every rank, forwarding output meanwhile; raise on failure."""
        replies: dict[int, tuple] = {}
        failures: list[tuple[int, RankError]] = []
        by_conn = {r.conn: r for r in self.ranks}
        grace_started = False
        while len(replies) + len(failures) < self.world_size:
            failed = {r for r, _ in failures}
            waiting = [r for r in self.ranks if r.rank not in replies and r.rank not in failed]
            now = time.monotonic()
            if now >= deadline:
                if failures:
                    break
                raise self._timeout_error([r.rank for r in waiting], timeout, starting)
            handles: list = [r.conn for r in waiting]
            fds = {fd: r for r in self.ranks for fd in (r.out, r.err) if fd >= 0}
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
            first.failures = dict(failures)
            done = set(replies) | {r for r, _ in failures}
            unfinished = [r.rank for r in self.ranks if r.rank not in done]
            if unfinished:
                first.others.append(f"ranks {unfinished} were still running and were killed")
                if self.cluster is not None:  # where they were, for the cluster's fault report
                    first.stacks = self._dump_stacks(unfinished)
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
        stacks = self._dump_stacks(stalled)
        return RankTimeoutError(stalled, self.world_size, timeout, stacks, starting)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """The Python stack each of ``ranks`` is in now (most recent call first), where the
        rank is alive to dump it."""
        stacks: dict[int, str] = {}
        for r in self.ranks:
            if r.rank in ranks and r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, signal.SIGUSR1)  # faulthandler dumps the rank's stack
                except ProcessLookupError:
                    pass
        time.sleep(0.3)
        for r in self.ranks:
            if r.rank in ranks:
                try:
                    with open(r.stack_file) as f:
                        stacks[r.rank] = annotate_stack(learner_stack(f.read()))
                except OSError:
                    pass
        return stacks

    def stop(self) -> None:
        """Ask every rank to leave the process group and exit; warn about any that does not."""
        if not self.ranks:
            return
        for r in self.ranks:
            try:
                r.conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 15
        for r in self.ranks:
            while r.proc.poll() is None and time.monotonic() < deadline:
                self._drain(0.05)
        self._drain()
        codes = {r.rank: r.proc.poll() for r in self.ranks}
        self.kill()
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

    def kill(self) -> None:
        """Kill every rank and everything it started (its own process group), at once."""
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    r.proc.kill()
        for r in self.ranks:
            try:
                r.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
                pass
            r.conn.close()
            for fd in (r.out, r.err):
                if fd >= 0:
                    os.close(fd)
        self.ranks = []
        self._partial.clear()
        self._store = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
