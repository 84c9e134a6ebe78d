"""Starting a rank fast: fork it from a server process that has imported torch already.

A rank started as a fresh interpreter (``python -m dpcourse.harness.launch.worker FD``) spends most
of its start-up importing torch: about 1.7 s of CPU on the course's 2-core CI machine, paid again
for every rank of every run that is not kept. Python's multiprocessing *fork server* avoids that:
a fresh interpreter, started once per caller, imports what it is told to preload (here torch)
and then forks a child for each request. The child has torch in memory already (shared with the
server, copy-on-write) and is ready in tens of milliseconds. The server never imports the
caller's ``__main__``, so a rank still never re-imports the caller: it is what a new interpreter
is after ``import torch``, and :func:`dpcourse.harness.launch.worker.forked_main` makes it look
like one to the rest of the launcher (its own session, its pipes as stdout and stderr, the caller's
environment).

:func:`start_rank` starts one rank and returns an object with the ``pid``, ``poll``, ``wait``
and ``kill`` of :class:`subprocess.Popen`. It forks where the platform has a fork server, unless
``DPCOURSE_START_METHOD=spawn`` asks for fresh interpreters, or environment variables that are
read while torch is imported (``OMP_*``, ``MKL_*``, ``TORCH_*``, ``PYTHON*``, ...) have changed
since the server started: a forked rank would not see the change, so that rank is spawned.

The server exits when its caller does (it watches a pipe that only the caller holds open); its
ranks then see their parent change and exit within a second, as spawned ranks do when the
caller dies.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from multiprocessing import forkserver, reduction
from multiprocessing.connection import wait

from dpcourse.harness.launch import worker

# What the server imports once, so that no rank has to. torch._dynamo: torch.optim imports it
# at a rank's first AdamW step (torch 2.13), 1.2 s on the course's 2-core machine, in every rank
# that trains; preloaded, chapters 8 and 9 ran under nbval
# in 50.4 s instead of 62.9 s, tests/test_zero.py and test_fsdp.py in 22-24 s instead of 26-29.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle"]
# Environment variables whose value is read while torch (and its OpenMP/MKL) is imported.
_IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "PYTHON", "LD_")

_server_environment: dict[str, str] | None = None  # those variables when our server started
_server_pid: int | None = None


def _import_time_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


def start_method() -> str:
    """``"forkserver"`` or ``"spawn"``: how :func:`start_rank` starts ranks here and now."""
    choice = os.environ.get("DPCOURSE_START_METHOD", "forkserver")
    if choice not in ("forkserver", "spawn"):
        raise ValueError(
            f"DPCOURSE_START_METHOD must be 'forkserver' or 'spawn', got {choice!r}"
        )
    if choice == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    if _server_environment is not None and _server_environment != _import_time_environment():
        return "spawn"
    return "forkserver"


def server_pid() -> int | None:
    """The fork server's process id, once this process has started one (for tests)."""
    return _server_pid


def ensure_server() -> None:
    """Start the fork server now, if it is not running (it starts at the first fork anyway):
    a caller that will fork soon lets the server import torch while it does other work."""
    global _server_environment, _server_pid

    if _server_environment is None:
        forkserver.set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()
    pid = forkserver._forkserver._forkserver_pid
    if pid != _server_pid:  # first start, or the server died and multiprocessing restarted it
        _server_pid, _server_environment = pid, _import_time_environment()


def fork_server_here(close_fds: tuple[int, ...] = ()) -> bool:
    """Make this process's fork server a fork of the process itself, not a fresh interpreter
    that imports torch again (about 2 s here): for a process that has torch imported, runs no
    other thread and has not yet run code it does not trust, such as the grader's player
    (:mod:`dpcourse.harness.exercises.player`) before a learner's code, whose ranks then start
    at once. The server closes ``close_fds`` (so that ranks do not hold them). False, doing
    nothing, where a server runs already or multiprocessing's differs from Python 3.10-3.12's
    (3.13 authenticates its clients)."""
    global _server_environment, _server_pid
    # import here: rarely used
    from multiprocessing import connection, resource_tracker, util  # noqa: PLC0415

    server = forkserver._forkserver
    if (start_method() != "forkserver" or server._forkserver_pid is not None
            or hasattr(server, "_forkserver_authkey")):
        return False
    forkserver.set_forkserver_preload(_PRELOAD)  # what a restarted server would load
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: multiprocessing's own loop, as a spawned server runs it
        try:
            os.close(alive_w)
            for fd in close_fds:
                os.close(fd)
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(1)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = _server_pid = pid
    _server_environment = _import_time_environment()
    return True


class _ForkedStart:
    """What a forked child receives from the caller (through the server) and runs: the fork
    server calls its ``_bootstrap``, as it would a multiprocessing ``Process``'s."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        fd, stdout, stderr = forkserver.get_inherited_fds()
        worker.forked_main(fd, stdout, stderr, self.env)  # never returns
        return 1


class ForkedRank:
    """A rank forked from the server: the part of :class:`subprocess.Popen` the launcher uses.

    The rank is the server's child, not ours: the server reports its exit code over the pipe
    ``status`` (after its pid), which is how ``poll`` and ``wait`` learn it."""

    def __init__(self, pid: int, status: int):
        self.pid = pid
        self.returncode: int | None = None
        self._status = status

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            if not wait([self._status], timeout):
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0)
            try:
                self.returncode = forkserver.read_signed(self._status)
            except (OSError, EOFError):  # the server itself was killed
                self.returncode = 255
            os.close(self._status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def start_rank(
    fd: int, stdout: int, stderr: int, env: dict[str, str]
) -> subprocess.Popen | ForkedRank:
    """Start a rank running :mod:`dpcourse.harness.launch.worker` on the socket ``fd``, writing to
    the pipes ``stdout`` and ``stderr``, with environment ``env``, in a session of its own (so that
    one ``killpg`` ends it and anything it starts). The caller keeps and closes its own copies
    of the three descriptors."""
    if start_method() == "spawn":
        return subprocess.Popen(
            [sys.executable, "-m", "dpcourse.harness.launch.worker", str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
        )

    return fork_from_server(_ForkedStart(env), [fd, stdout, stderr])


def fork_from_server(start: object, fds: list[int]) -> ForkedRank:
    """Fork a child of the fork server (started here if need be) that runs
    ``start._bootstrap()``, where ``start`` is a picklable object and the child gets its copies
    of the descriptors ``fds`` from ``multiprocessing.forkserver.get_inherited_fds()``. Ranks
    are started so (:func:`start_rank`), and the grader's processes that run a learner's code
    (:mod:`dpcourse.harness.exercises.player`). The caller keeps and closes its own copies."""
    ensure_server()
    status, data = forkserver.connect_to_new_process(fds)
    try:
        with open(data, "wb", closefd=True) as f:
            # multiprocessing's preparation data, without the caller's __main__ (which a
            # multiprocessing Process would re-import in the child): the path and the directory.
            reduction.dump({"sys_path": sys.path, "dir": os.getcwd()}, f)
            reduction.dump(start, f)
        pid = forkserver.read_signed(status)
    except BaseException:
        os.close(status)
        raise
    return ForkedRank(pid, status)
