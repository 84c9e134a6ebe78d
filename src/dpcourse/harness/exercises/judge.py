"""The judge: the grader's process that decides each exercise's verdict and never runs a line of
a learner's code.

For each exercise of a submission it reads the notebook's code without running it
(:class:`~dpcourse.harness.exercises.notebook_code.Notebook`), picks the statements the
exercise's function needs, and starts a player
(:mod:`~dpcourse.harness.exercises.player`), a process of its own, to run them:

* the exercises in :data:`JUDGED_APART` (their checks give the function data and look only at
  what it returns) are checked here: the check, its reference and its comparisons run in the
  judge, and each call of the learner's function goes to the player and back as data
  (:mod:`~dpcourse.harness.exercises.learner_data`). Nothing the learner's code does reaches the
  verdict;
* the others (their checks run the function on ranks, or hand it modules and optimizers to
  change) are checked in the player, which loads the checks before the learner's code; its
  report is the verdict, so a function written to attack the grader can forge its own
  exercise's (the instructor guide says so).

An answer that is, or calls, a function of the course package that passes the exercise's check
by itself is reported as the course's own code (:func:`course_answer`).

The grader (:mod:`~dpcourse.harness.exercises.grading`) starts judges with ``python -I`` (no
working folder on the path) running :func:`main`, and sends one JSON line per submission on
their standard input; each answers one JSON line on its standard output.

Chapter 0: the exercise checks of the whole course (grading).
"""

from __future__ import annotations

import ast
import builtins
import functools
import json
import linecache
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import torch

from dpcourse.harness.exercises import learner_data
from dpcourse.harness.exercises.core import (
    CheckResult,
    Mismatch,
    describe_value,
    registry,
    run_check,
)
from dpcourse.harness.exercises.notebook_code import Notebook, Statement, course_callables
from dpcourse.harness.exercises.player import ForkedPlayer
from dpcourse.harness.launch import forkserver

__all__ = ["JUDGED_APART", "IN_PROCESS", "judged_apart", "names_used", "Verdict",
           "judge_notebook", "course_answer", "main"]

# The exercises whose checks call the learner's function with data only (numbers, strings,
# lists, tensors) and look only at what it returns: their verdict is reached in the judge
# (unless the check names one of IN_PROCESS). tests/test_grading_isolation.py checks that the
# book's own answers pass so.
JUDGED_APART = frozenset({
    "ex-1-batch", "ex-2-combine", "ex-3-chunk", "ex-5-rounds", "ex-6-bytes",
    "ex-7-buckets", "ex-7-sampler", "ex-8-lr", "ex-8-recovery",
    "ex-9-shard-bounds", "ex-9-memory", "ex-9-fsdp-chunks", "ex-9-fsdp-order",
    "ex-10-step-time", "ex-10-largest-n", "ex-10-noise-scale", "ex-10-hide",
    "ex-11-fsdp-bytes", "ex-11-accumulate", "ex-11-node-bytes",
    "ex-lab-straggler", "ex-lab-hang", "ex-lab-buckets", "ex-lab-bandwidth",
    "ex-bugs-noam", "ex-bugs-collate",
})
# What a check uses to look at the learner's function from inside the process that runs it (an
# argument changed in place, memory shared with an argument, devices modelled on the CPU, ranks,
# the learner's own frames): a check whose code names one is checked in the player, whatever
# JUDGED_APART says (judged_apart).
IN_PROCESS = frozenset({"call_learner_in_place", "as_on_gpus",
                        "shares_memory", "run_learner_on_ranks", "call_collective",
                        "learner_messages", "learner_error"})
# Seconds beyond a check's own limit that a player running it may take (rank start-up and
# teardown) before the judge stops it.
LOCAL_MARGIN = 30.0
STARTUP_TIMEOUT = 120.0  # seconds for a player to be ready, before any of the learner's code
MAX_MESSAGE_BYTES = 64 * 2**20  # one reply of a player; more is not an answer
OUTPUT_TAIL = 2000  # characters of what the learner's code printed, kept for the feedback
# The grader's own settings, which a learner's process must not inherit.
GRADER_ENV = ("DPCOURSE_CHECKS_STRICT", "DPCOURSE_KEEP_RANKS")


class _Unsendable(BaseException):
    """A judged-apart check gave the learner's function something that is not data: the
    grader's mistake (:data:`JUDGED_APART` lists an exercise it should not), not the learner's.
    A BaseException, so that the check's handling of the learner's errors does not catch it."""


@dataclass
class Verdict:
    """What the judge decided for one exercise of one submission."""

    label: str
    status: str  # passed, failed, not attempted, missing, course code, not run, error
    message: str
    mode: str = ""  # "apart" (checked in the judge) or "local" (checked in the player)
    cells: list[str] = field(default_factory=list)  # the cells whose code ran, as Jupyter shows
    problems: list[str] = field(default_factory=list)  # errors in those cells
    output: str = ""  # the end of what the learner's code printed
    course_code: str = ""  # the course function the answer is or calls, if any


def names_used(fn: Any) -> set[str]:
    """The global and attribute names ``fn``'s code uses, and that of the functions of its own
    module it names, in turn (what a check does, read from its bytecode)."""
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    found: set[str] = set()
    todo, seen = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in seen or not hasattr(f, "__code__"):
            continue
        seen.add(id(f))
        names: set[str] = set()
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        found |= names
        for name in names:
            other = getattr(module, name, None)
            if getattr(other, "__module__", None) == getattr(module, "__name__", None):
                todo.append(other)
    return found


@functools.cache
def judged_apart(label: str) -> bool:
    """Whether exercise ``label`` is checked in the judge: it is in :data:`JUDGED_APART` and its
    check names nothing of :data:`IN_PROCESS`."""
    return label in JUDGED_APART and not names_used(registry()[label].check) & IN_PROCESS


# ------------------------------------------------------------------------------------ players
class Player:
    """The judge's end of one player process (see :mod:`~dpcourse.harness.exercises.player`)."""

    def __init__(self, job: dict, workdir: Path):
        self.output = workdir / "output.txt"
        ours, theirs = socket.socketpair()
        out = os.open(self.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if forkserver.start_method() == "forkserver":
                self.proc = forkserver.fork_from_server(ForkedPlayer(), [theirs.fileno(), out])
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-m", "dpcourse.harness.exercises.player",
                     str(theirs.fileno()), str(out)],
                    pass_fds=(theirs.fileno(), out), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=out, start_new_session=True, cwd=workdir,
                )
        finally:
            theirs.close()
            os.close(out)
        self.conn = Connection(os.dup(ours.fileno()))
        ours.close()
        self.conn.send_bytes(json.dumps(job).encode())

    def send(self, **message: Any) -> None:
        self.conn.send_bytes(json.dumps(message).encode())

    def receive(self, timeout: float | None) -> dict | None:
        """The player's next message; None if none came within ``timeout`` seconds (None: wait
        as long as it takes, or until a signal's handler raises). ``EOFError`` if it ended."""
        if timeout is not None and not self.conn.poll(max(timeout, 0)):
            return None
        try:
            data = self.conn.recv_bytes(MAX_MESSAGE_BYTES)
        except OSError as exc:  # more than MAX_MESSAGE_BYTES, or a broken socket
            raise EOFError(str(exc)) from None
        try:
            message = json.loads(data)
        except ValueError:
            raise EOFError("it sent something that is not a message") from None
        if not isinstance(message, dict):
            raise EOFError("it sent something that is not a message")
        return message

    def ended(self) -> str:
        """How the process ended, in words (after :meth:`receive` raised ``EOFError``)."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            oom = " (the machine's out-of-memory killer sends it)" if -code == 9 else ""
            return f"was killed by {name}{oom}"
        return f"exited with status {code}"

    def printed(self) -> str:
        """The end of what the learner's code printed."""
        try:
            with open(self.output, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - OUTPUT_TAIL))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        """Kill the player and whatever it started in its session."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


def _raise_at(error: dict) -> NoReturn:
    """Raise, here, what the learner's function raised in the player: an exception of the same
    name and text whose innermost frame is the learner's line (what the checks quote)."""
    name = str(error.get("type", "Exception"))
    builtin = getattr(builtins, name, None)  # ValueError is ValueError (a check may want one);
    if not (isinstance(builtin, type) and issubclass(builtin, Exception)):  # others, a new class
        builtin = None
    message = str(error.get("message", ""))
    try:
        exc = (builtin or type(name, (Exception,), {}))(message)
    except Exception:  # a builtin that takes other arguments (UnicodeDecodeError)
        exc = type(name, (Exception,), {})(message)
    filename, line = error.get("filename"), error.get("line")
    if isinstance(filename, str) and isinstance(line, int) and 0 < line < 100_000:
        linecache.cache[filename] = (0, None, [""] * (line - 1) + [f"{error.get('source')}\n"],
                                     filename)
        exec(compile("\n" * (line - 1) + "raise exc", filename, "exec"), {"exc": exc})
    raise exc


class LearnerFunction:
    """The learner's function as a judged-apart check sees it: each call goes to the player,
    and what comes back is data (or the learner's exception, raised again here)."""

    def __init__(self, player: Player, name: str):
        self.player = player
        self.__name__ = self.__qualname__ = name
        self.learner_file: str | None = None  # where its code is (the check quotes its line)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            request = {"args": learner_data.encode(list(args)),
                       "kwargs": learner_data.encode(kwargs)}
        except learner_data.NotData as exc:
            raise _Unsendable(f"the check passes {exc} to the function") from None
        inputs = ", ".join(describe_value(a) for a in args)
        try:
            self.player.send(**request)
            reply = self.player.receive(None)  # the check's time limit interrupts a long wait
        except (EOFError, OSError):
            raise Mismatch(f"when called with ({inputs}), the process running your function "
                           f"{self.player.ended()}") from None
        event = reply.get("event")
        if event == "returned":
            try:
                if "args" in reply:  # what the call changed in place, changed here too
                    for mine, theirs in zip(args, learner_data.decode(reply["args"]),
                                            strict=False):
                        _mirror(mine, theirs)
                return learner_data.decode(reply["value"])
            except Exception as exc:  # whatever the player sent: the learner's process
                raise Mismatch(f"when called with ({inputs}), your function returned something "
                               f"the grader could not read ({exc})") from None
        if event == "not data":
            raise Mismatch(
                f"when called with ({inputs}), your function returned {reply.get('what')}: the "
                "grader takes back only data (numbers, strings, lists, tuples, dicts, tensors)")
        if event == "raised" and isinstance(reply.get("error"), dict):
            if reply["error"].get("not_implemented"):
                raise NotImplementedError(str(reply["error"].get("message", "")))
            if isinstance(reply["error"].get("filename"), str):
                self.learner_file = reply["error"]["filename"]
            _raise_at(reply["error"])
        raise Mismatch(f"when called with ({inputs}), the process running your function "
                       "answered something that is not a result")


def _mirror(mine: Any, theirs: Any) -> None:
    """Change the judge's arguments ``mine`` in place as the learner's call changed its copies
    (``theirs``, sent back after the call): tensors' values, lists' and dicts' contents, so that
    a check that wants its arguments untouched (:func:`~.core.call_learner_untouched`) sees
    what the call did to them. What cannot change in place (a tensor's shape) is left."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.shape == theirs.shape and not mine.is_meta:
            with torch.no_grad():
                mine.copy_(theirs.to(mine.device, mine.dtype))
    elif isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) == len(theirs) and all(
                isinstance(a, (torch.Tensor, list, dict)) for a in mine):
            for a, b in zip(mine, theirs, strict=True):
                _mirror(a, b)
        else:
            mine[:] = theirs
    elif isinstance(mine, dict) and isinstance(theirs, dict):
        if mine.keys() == theirs.keys():
            for k in mine:
                if isinstance(mine[k], (torch.Tensor, list, dict)):
                    _mirror(mine[k], theirs[k])
                else:
                    mine[k] = theirs[k]
        else:
            mine.clear()
            mine.update(theirs)


# ------------------------------------------------------------------------- the course's answers
_answers_alone: dict[tuple[str, str], bool] = {}


def course_answer(label: str, statements: list[Statement], function: str) -> tuple[str, bool]:
    """The course package's function that an answer to ``label`` (the ``statements`` defining
    ``function``) names and that passes the exercise's check by itself, and whether the answer is
    that function itself (``my_f = module.f``) rather than a function calling it; ``("", False)``
    if there is none. Each such function's check runs here, once per judge: course code only."""
    found = course_callables(statements)
    answering = []
    for path, obj in found.items():
        if (label, path) not in _answers_alone:
            _answers_alone[(label, path)] = run_check(label, obj).passed
        if _answers_alone[(label, path)]:
            answering.append(path)
    if not answering:
        return "", False
    aliases = [s for s in statements if function in s.binds
               and isinstance(s.node, (ast.Assign, ast.AnnAssign))
               and isinstance(s.node.value, (ast.Attribute, ast.Name))]
    for s in aliases:
        alias = course_callables(statements, within=s.node.value)
        for path in answering:
            if path in alias:
                return path, True
    return answering[0], False


# ------------------------------------------------------------------------------------ verdicts
def _grader_folders() -> list[str]:
    """Folders of this machine that messages must not show (the package's, Python's, the
    temporary ones), longest first."""
    # import here: only its location is wanted
    import dpcourse  # noqa: PLC0415

    folders = {str(Path(dpcourse.__file__).resolve().parents[1]), sys.prefix, sys.base_prefix,
               sys.exec_prefix, tempfile.gettempdir(), str(Path.home()),
               *site.getsitepackages(), *(p for p in sys.path if p and Path(p).is_dir())}
    return sorted({f.rstrip("/") for f in folders if len(f) > 1}, key=len, reverse=True)


def without_paths(text: str) -> str:
    """``text`` with this machine's folders cut from the paths in it (a rank's traceback names
    the check's file): ``dpcourse/harness/exercises/ch07.py``, not where it is installed."""
    for folder in _grader_folders():
        text = text.replace(folder + "/", "")
    return text


def _player_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in GRADER_ENV}
    env.update(HOME=str(workdir), TMPDIR=str(workdir))
    return env


def judge_exercise(nb: Notebook, label: str, options: dict, deadline: float,
                   root: Path) -> Verdict:
    """The verdict on exercise ``label`` of the notebook ``nb``, by ``deadline`` (a
    ``time.monotonic()``), with scratch folders under ``root``."""
    ex = registry()[label]
    name = ex.function
    statements = nb.needed({name})
    mode = "apart" if judged_apart(label) else "local"
    verdict = Verdict(label, "not run", "", mode)
    verdict.cells = list(dict.fromkeys(s.cell.describe() for s in statements))
    problems = nb.cell_problems(statements, {name})
    verdict.problems.extend(problems)
    if not any(name in s.binds for s in statements):
        verdict.status = "missing"
        verdict.message = (f"no function called {name!r} is defined in the notebook (was its "
                           "cell deleted or renamed?)")
        return verdict
    path, alias = course_answer(label, statements, name)
    if path:
        verdict.course_code = path
        what = "is" if alias else "calls"
        note = (f"your answer {what} {path}, the course's own function, which passes this "
                "check by itself")
        if not options.get("course_code_counts"):
            verdict.status, verdict.message = "course code", note + " (not counted)"
            return verdict
    workdir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=root))
    cells = {str(s.cell.index): {"filename": s.cell.filename, "source": s.cell.source}
             for s in statements}
    job = {"env": _player_env(workdir), "dir": str(workdir), "mode": mode, "label": label,
           "function": name, "cells": cells,
           "statements": [[str(s.cell.index), s.index] for s in statements]}
    by_index = {str(c.index): c for c in nb.cells}
    player = Player(job, workdir)
    try:
        _run(player, verdict, by_index, ex, options, deadline)
    finally:
        player.close()
        verdict.output = player.printed()
        shutil.rmtree(workdir, ignore_errors=True)
    if path and verdict.status == "passed":
        verdict.message = f"{note}. {verdict.message}"
    return verdict


def _run(player: Player, verdict: Verdict, cells: dict, ex, options: dict,
         deadline: float) -> None:
    cell_timeout = float(options.get("cell_timeout", 300))
    try:
        ready = player.receive(min(STARTUP_TIMEOUT, max(deadline - time.monotonic(), 0)))
    except EOFError:
        ready = None
    if not ready or ready.get("event") != "ready":
        verdict.status = "error"
        verdict.message = "the grader could not start a process for this exercise; please report it"
        return
    running = None
    while True:  # the cells the function needs, then whether it exists
        wait = min(cell_timeout, deadline - time.monotonic())
        try:
            message = player.receive(wait)
        except EOFError:
            where = f"while running {cells[running].describe()}" if running else "at its start"
            verdict.status = "failed"
            verdict.message = f"the process running your code {player.ended()} {where}"
            return
        if message is None:
            where = cells[running].describe() if running else "the notebook's code"
            limit = (f"the time limit of {cell_timeout:g} s for a cell" if wait == cell_timeout
                     else "the time left for this notebook")
            verdict.status = "failed"
            verdict.message = (f"{where} was still running after {limit}, and was stopped: "
                               f"{ex.function} could not be checked")
            return
        event = message.get("event")
        if event == "cell" and str(message.get("cell")) in cells:
            running = str(message["cell"])
        elif event == "raised" and str(message.get("cell")) in cells:
            e = message.get("error") or {}
            line = f", line {e['line']}" if isinstance(e.get("line"), int) else ""
            verdict.problems.append(f"{cells[str(message['cell'])].describe()} raised "
                                    f"{e.get('type')}: {e.get('message')}{line}")
        elif event == "defined":
            break
    if not message.get("found"):
        verdict.status = "missing"
        verdict.message = f"no function called {ex.function!r} was defined when its cells ran"
        return
    if not message.get("callable"):
        verdict.status = "failed"
        verdict.message = (f"{ex.function} is a {message.get('type')}, not a function")
        return
    if verdict.mode == "apart":
        try:  # within the check's own time limit (run_check's)
            result = run_check(verdict.label, LearnerFunction(player, ex.function))
        except _Unsendable as exc:
            result = CheckResult(verdict.label, ex.name, "error",
                                 f"the grader cannot judge this exercise apart ({exc}); "
                                 "please report it")
    else:
        try:
            message = player.receive(min(ex.timeout + LOCAL_MARGIN,
                                         deadline - time.monotonic()))
        except EOFError:
            verdict.status = "failed"
            verdict.message = (f"the process running the check {player.ended()} while "
                               f"checking {ex.function}")
            return
        if message is None:
            verdict.status = "failed"
            verdict.message = (f"the check of {ex.function} was still running after "
                               f"{ex.timeout + LOCAL_MARGIN:g} s, and was stopped")
            return
        r = message.get("result") if message.get("event") == "result" else None
        if not isinstance(r, dict):
            verdict.status, verdict.message = "failed", "the check gave no result"
            return
        result = CheckResult(verdict.label, ex.name, str(r.get("status")),
                             str(r.get("message")))
    verdict.status, verdict.message = result.status, result.message


def judge_notebook(request: dict) -> dict:
    """The verdicts on one submission: ``request`` holds the notebook's JSON text
    (``notebook``), the exercises' labels (``exercises``), ``timeout`` (seconds for all of
    them), ``cell_timeout`` and ``course_code_counts``; the answer, ``{"verdicts": [...]}``."""
    deadline = time.monotonic() + float(request.get("timeout", 900))
    nb = Notebook(json.loads(request["notebook"]))
    root = Path(tempfile.mkdtemp(prefix="dpcourse-judge-"))
    verdicts = []
    try:
        for label in request["exercises"]:
            if time.monotonic() >= deadline:
                verdicts.append(Verdict(label, "not run", "the time for this notebook ran out "
                                        "before this exercise"))
                continue
            try:
                verdicts.append(judge_exercise(nb, label, request, deadline, root))
            except Exception as exc:  # the judge's own mistake: not the learner's
                verdicts.append(Verdict(label, "error", f"the grader failed ({type(exc).__name__}"
                                        f": {exc}); please report it"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for v in verdicts:
        v.message = without_paths(v.message)
        v.problems = [without_paths(p) for p in v.problems]
        v.output = without_paths(v.output)
    return {"verdicts": [asdict(v) for v in verdicts]}


def main() -> None:
    """The judge's process: answer each request line on standard input with a line on standard
    output (what checks print goes to standard error)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if forkserver.start_method() == "forkserver":
        forkserver.ensure_server()  # it imports torch while this process loads the checks
    registry()
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(judge_notebook(json.loads(line))) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
