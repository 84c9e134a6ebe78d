"""What each rank runs under :mod:`dpcourse.harness.launch`: ``python -m
dpcourse.harness.launch.worker FD``,
or :func:`forked_main` in a rank forked from the fork server
(:mod:`dpcourse.harness.launch.forkserver`).

It joins the process group through the store its parent hosts, then serves jobs sent over the
socket ``FD`` until it is told to stop: each job is ``(fn, args, kwargs)`` serialised by value
with cloudpickle, so a function defined in a notebook cell or a script's ``__main__`` works.
Replies are ``("ready",)``, ``("result", bytes)`` or ``("error", type name, message,
traceback, pickled exception or None)``.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.harness import device_audit
from dpcourse.harness.launch.job import error_reply, run_job

# Seconds a rank waits to leave its process group when told to stop (the launcher waits 15).
_TEARDOWN_TIMEOUT = 5.0


def _watch_parent(parent_pid: int) -> None:
    # The ranks live in their own session (so that the launcher can kill a rank and anything it
    # started in one go); without this they would outlive a crashed or killed notebook kernel.
    # (A forked rank's parent is the fork server, which exits when the caller does.)
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(70)


def main() -> None:
    """``python -m dpcourse.harness.launch.worker FD``: a rank as a fresh interpreter."""
    serve(int(sys.argv[1]))


def forked_main(fd: int, stdout: int, stderr: int, env: dict[str, str]) -> None:
    """A rank forked from the fork server: become what :func:`main` starts as (a session of its
    own, the launcher's pipes as stdout and stderr, the caller's environment), then serve."""
    os.setsid()
    for pipe, target in ((stdout, 1), (stderr, 2)):
        os.dup2(pipe, target)
        os.close(pipe)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), "utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), "utf-8", "backslashreplace", line_buffering=True
    )
    os.environ.clear()
    os.environ.update(env)
    serve(fd)


def _enter_network_namespace(path: str) -> None:
    """Move this process into the network namespace at ``path`` (a node of
    :class:`dpcourse.harness.cluster.EmulatedCluster`), before it opens any socket or thread that
    talks to the network: threads started afterwards (gloo's) inherit the namespace."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, os.CLONE_NEWNET)
            return

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter the network namespace {path}: "
                          f"{os.strerror(errno)}")
    finally:
        os.close(fd)


def out_of_memory_message(
    exc: BaseException,
    rank: int,
    local_rank: int,
    local_world_size: int,
    gpus: int,
    memory: tuple[int, int] | None = None,
) -> str:
    """What a rank says when its GPU has no memory left for it while it joins the process group
    (``exc`` the error; ``memory`` the GPU's free and total bytes, where they could be read)."""
    gpu = local_rank % gpus if gpus > 0 else 0
    sharing = [r for r in range(local_world_size) if gpus <= 0 or r % gpus == gpu]
    text = (
        f"rank {rank} (local rank {local_rank} of {local_world_size}) found no free memory on "
        f"cuda:{gpu} while joining the process group. Local ranks "
        f"{', '.join(map(str, sharing))} of this pool share cuda:{gpu} "
        f"({gpus} GPU(s) on this machine)."
    )
    if memory is not None:
        free, total = memory
        text += f" cuda:{gpu} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB."
    return (
        text + " Each rank process holds a CUDA context and the memory its allocator caches, and "
        "so does every other pool of ranks, notebook kernel and test worker on this GPU: run "
        "fewer notebooks or test workers at once, set DPCOURSE_KEEP_RANKS lower (pools each "
        "kernel keeps open), or close other kernels (nvidia-smi lists what holds the GPU). "
        f"The error: {type(exc).__name__}: {exc}"
    )


def _out_of_memory_here(exc: BaseException) -> str:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    gpus, memory = 0, None
    try:
        gpus = torch.cuda.device_count()
        memory = torch.cuda.mem_get_info(local_rank % gpus)
    except Exception:
        pass
    return out_of_memory_message(exc, rank, local_rank, local_world_size, gpus, memory)


def serve(fd: int) -> None:
    """Join the process group, then run the jobs that arrive on the socket ``fd`` until told to
    stop; never returns."""
    conn = Connection(fd)
    stack_file = open(os.environ["DPCOURSE_STACK_FILE"], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    threads = int(os.environ.get("DPCOURSE_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        if os.environ.get("DPCOURSE_NETNS"):
            _enter_network_namespace(os.environ["DPCOURSE_NETNS"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=float(os.environ["DPCOURSE_START_TIMEOUT"])),
        )
        device_audit.enable_if_requested()  # a forked rank got its environment only now
        # How long a collective waits for a peer before it fails: an emulated cluster's
        # collective_timeout, else the course's default
        group_timeout = os.environ.get("DPCOURSE_GROUP_TIMEOUT")
        timeout = (datetime.timedelta(seconds=float(group_timeout)) if group_timeout
                   else runtime.DEFAULT_PG_TIMEOUT)
        try:
            runtime.init_process_group(os.environ["DPCOURSE_BACKEND"], store=store,
                                       timeout=timeout)
        except Exception as exc:
            if "out of memory" not in str(exc).lower():
                raise
            raise RuntimeError(_out_of_memory_here(exc)) from exc
    except BaseException as exc:
        conn.send(error_reply(exc, 0))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    conn.send(("ready",))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        reply = run_job(message[1])
        # Output written before the reply must reach the parent before the reply does.
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)

    # Leave the process group, but never wait long for it: on one H200, NCCL's destroy kept a
    # lone rank past the launcher's 15 s (the process exits without interpreter shutdown anyway).
    leaving = threading.Thread(target=runtime.teardown, daemon=True)
    leaving.start()
    leaving.join(_TEARDOWN_TIMEOUT)
    runtime.end_process(0)


if __name__ == "__main__":
    main()
