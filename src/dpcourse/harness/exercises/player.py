"""The process that runs a learner's code for the grader: one per exercise of a submission.

The judge (:mod:`~dpcourse.harness.exercises.judge`) starts it, forked from the launcher's fork
server (:func:`dpcourse.harness.launch.forkserver.fork_from_server`: torch is imported already)
or as ``python -I -m dpcourse.harness.exercises.player SOCKET OUTPUT``, in a session of its own
(one ``killpg`` ends it and what it started), its output going to a file, and sends it a job over
the socket: the cells' code, which of their statements to run, the function to look up, and the
mode:

* ``"apart"``: the judge runs the check in its own process and calls the learner's function
  here, one call at a time: the arguments and what it returns cross as data
  (:mod:`~dpcourse.harness.exercises.learner_data`), so the learner's code never shares a
  process with the check, its reference or the verdict;
* ``"local"``: the check runs here, on the function (checks that hand it to ranks, or give it
  modules and optimizers to change); the check's code is imported before any of the learner's
  runs.

It reports as it goes (JSON messages): that it is ready (set up, before the learner's code),
each cell it starts (so that the judge can stop a cell that runs too long and say which), each
statement that raised, whether the function was defined, and the calls' results or the check's.

Chapter 0: the exercise checks of the whole course (grading).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import io
import json
import linecache
import os
import resource
import signal
import sys
import traceback
import types
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from dpcourse.harness.exercises import learner_data, registry, run_check
from dpcourse.harness.launch import forkserver

__all__ = ["serve", "learner_error", "ForkedPlayer"]

MESSAGE_CHARS = 600  # of an exception's text, in a message
FILE_LIMIT = 64 * 2**20  # bytes of any file the learner's code writes, its output included


def learner_error(exc: BaseException) -> dict[str, Any]:
    """An exception the learner's code raised, as the judge reports it: its type and text, and the
    line of the learner's cell it came from (the innermost frame in a cell)."""
    text = str(exc)
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "…"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.startswith("<cell ")]
    where = frames[-1] if frames else None
    return {
        "type": type(exc).__name__,
        "message": text,
        "not_implemented": isinstance(exc, NotImplementedError),
        "filename": where.filename if where else None,
        "line": where.lineno if where else None,
        "source": (where.line or "") if where else "",
    }


def _send(conn: Connection, **message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _detach() -> None:
    """A session of its own (a fork has its parent's), and death with its parent: a player
    never outlives the judge, even one killed outright."""
    try:
        os.setsid()
    except OSError:  # started as a session leader already (python -m ... start_new_session)
        pass
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the judge's killpg is the only stop
        pass


def serve(sock_fd: int, out_fd: int) -> int:
    """Run one job received on the socket ``sock_fd`` (see the module's docstring), writing the
    learner's output to ``out_fd``; the exit status."""
    _detach()
    for target in (1, 2):
        os.dup2(out_fd, target)
    os.close(out_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), "utf-8", line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), "utf-8", "backslashreplace",
                                  line_buffering=True)
    conn = Connection(sock_fd)
    job = json.loads(conn.recv_bytes())
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["dir"])
    # No file it writes, its output included, grows past FILE_LIMIT: a print in a loop that
    # never ends fails (OSError: File too large) instead of filling the grader's disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))
    local = job["mode"] == "local"
    if local:
        registry()  # the checks' code is loaded before any of the learner's runs
        # Ranks the check starts fork from a copy of this process as it is now, before the
        # learner's code: it has torch imported already.
        forkserver.fork_server_here(close_fds=(sock_fd,))

    module = types.ModuleType("__main__")  # what a notebook's kernel runs in: cloudpickle
    module.__dict__["__builtins__"] = builtins  # sends its functions to ranks by value
    sys.modules["__main__"] = module
    namespace = module.__dict__
    trees = {}
    for cell, code in job["cells"].items():
        linecache.cache[code["filename"]] = (len(code["source"]), None,
                                             code["source"].splitlines(True), code["filename"])
        trees[cell] = ast.parse(code["source"], code["filename"])
    _send(conn, event="ready")
    failed_cells = set()
    started = None
    for cell, k in job["statements"]:
        if cell in failed_cells:
            continue  # as in Jupyter: a cell stops at its first error
        if cell != started:
            _send(conn, event="cell", cell=cell)
            started = cell
        node = trees[cell].body[k]
        code = compile(ast.Module(body=[node], type_ignores=[]), job["cells"][cell]["filename"],
                       "exec")
        try:
            exec(code, namespace)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: a cell's error
            failed_cells.add(cell)
            _send(conn, event="raised", cell=cell, error=learner_error(exc))
    fn = namespace.get(job["function"])
    _send(conn, event="defined", found=job["function"] in namespace, callable=callable(fn),
          type=type(fn).__name__)
    if fn is None or not callable(fn):
        return 0
    if local:
        result = run_check(job["label"], fn)
        _send(conn, event="result", result=asdict(result))
        return 0
    while True:  # the judge's calls, until it closes the socket
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return 0
        args = learner_data.decode(request["args"])
        kwargs = learner_data.decode(request["kwargs"])
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            _send(conn, event="raised", error=learner_error(exc))
            continue
        try:  # the arguments too, as the call left them: the judge sees what it changed
            _send(conn, event="returned", value=learner_data.encode(value),
                  args=learner_data.encode(list(args)))
        except learner_data.NotData as exc:
            _send(conn, event="not data", what=str(exc))


class ForkedPlayer:
    """What the fork server's child runs (``_bootstrap``, which
    :func:`~dpcourse.harness.launch.forkserver.fork_from_server` calls): :func:`serve` on the
    two descriptors it inherited."""

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:
        # import here: a forked child's
        from multiprocessing import forkserver as server  # noqa: PLC0415

        sock_fd, out_fd = server.get_inherited_fds()
        return serve(sock_fd, out_fd)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2])))
