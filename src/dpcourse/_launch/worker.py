"""What each rank runs under :mod:`dpcourse.launch`: ``python -m dpcourse._launch.worker FD``.

It joins the process group through the store its parent hosts, then serves jobs sent over the
socket ``FD`` until it is told to stop: each job is ``(fn, args, kwargs)`` serialised by value
with cloudpickle, so a function defined in a notebook cell or a script's ``__main__`` works.
Replies are ``("ready",)``, ``("result", bytes)`` or ``("error", type name, message,
traceback, pickled exception or None)``.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def _watch_parent(parent_pid: int) -> None:
    # The ranks live in their own session (so that the launcher can kill a rank and anything it
    # started in one go); without this they would outlive a crashed or killed notebook kernel.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(70)


def _error_reply(exc: BaseException, skip_frames: int) -> tuple:
    import cloudpickle

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


def _run_job(payload: bytes) -> tuple:
    import cloudpickle

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
        return _error_reply(exc, 0)
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        return _error_reply(exc, 1)
    try:
        return ("result", cloudpickle.dumps(result))
    except BaseException as exc:
        exc.add_note("(the function returned, but its result could not be sent back to the caller)")
        return _error_reply(exc, 0)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    stack_file = open(os.environ["DPCOURSE_STACK_FILE"], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(
        target=_watch_parent, args=(int(os.environ["DPCOURSE_PARENT_PID"]),), daemon=True
    ).start()

    import datetime

    import torch
    import torch.distributed as dist

    from dpcourse import runtime

    threads = int(os.environ.get("DPCOURSE_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=float(os.environ["DPCOURSE_START_TIMEOUT"])),
        )
        runtime.init_process_group(os.environ["DPCOURSE_BACKEND"], store=store)
    except BaseException as exc:
        conn.send(_error_reply(exc, 0))
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
        reply = _run_job(message[1])
        # Output written before the reply must reach the parent before the reply does.
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)

    runtime.teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter shutdown: letting C++ static destructors run after gloo's threads was
    # seen to abort a rank ("terminate called without an active exception") once in ~30 runs.
    os._exit(0)


if __name__ == "__main__":
    main()
