"""Run a script or a module under ``torchrun`` in a subprocess and wait for it.

:func:`run_torchrun` is the one harness for it: the tests start the command-line trainer and
small scripts with it, the way chapter 8 starts ``python -m dpcourse.train``. It runs
``python -m torch.distributed.run --standalone`` (``torchrun``, from the same Python), so it
needs no ``torchrun`` on the ``PATH``, and the ranks import the same ``dpcourse`` as the caller.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run_torchrun"]


def run_torchrun(
    target: str | os.PathLike,
    nproc: int,
    args: Sequence[str | os.PathLike] = (),
    *,
    module: bool = False,
    timeout: float = 240.0,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=nproc target *args``; returns the finished process
    (``returncode``, ``stdout`` and ``stderr`` as text) without raising on failure.

    ``target`` is a script's path, or a module's name with ``module=True`` (``-m target``).
    ``max_restarts`` is torchrun's: how often it restarts the whole group after a rank fails.
    ``env`` adds to (or overrides) this process's environment; output is unbuffered. Raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        *(["-m", str(target)] if module else [str(target)]),
        *(str(a) for a in args),
    ]  # fmt: skip
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds dpcourse/
    pythonpath = [
        package_root,
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
    ]
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
