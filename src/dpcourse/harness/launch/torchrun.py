"""Run a script or a module under ``torchrun`` in a subprocess and wait for it.

:func:`run_torchrun` is the one harness for it: the tests start the command-line trainer and
small scripts with it, the way chapter 8 starts ``python -m dpcourse.practice.train``. It runs
``python -m torch.distributed.run --standalone`` (``torchrun``, from the same Python), so it
needs no ``torchrun`` on the ``PATH``, and the ranks import the same ``dpcourse`` as the caller.

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpcourse.harness.cluster import EmulatedCluster

__all__ = ["run_torchrun", "run_torchrun_on_cluster"]


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
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive int (processes to start), got {nproc!r}")
    check_target(target, module)
    check_options(timeout, max_restarts)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        *(["-m", str(target)] if module else [str(target)]),
        *(str(a) for a in args),
    ]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_environment(env), cwd=cwd
    )


def check_target(target: str | os.PathLike, module: bool) -> None:
    """A clear error for a script that is not there (a module's name is checked by torchrun's
    workers, which import it)."""
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"target must be a script's path or, with module=True, a module's name; "
                        f"got {target!r}")
    if not module and not Path(target).is_file():
        hint = (" (to run a module, pass its name with module=True)"
                if "." in str(target) and "/" not in str(target) else "")
        raise FileNotFoundError(f"no script at {str(target)!r}: pass the path of a Python "
                                f"script{hint}")


def check_options(timeout: float, max_restarts: int = 0) -> None:
    """A clear error for a timeout that is not a positive number of seconds or a number of
    restarts that is not an int from 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds above 0, got {timeout!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int from 0 (how often torchrun restarts the "
                         f"workers after a failure), got {max_restarts!r}")


def check_cluster(cluster, port: int) -> None:
    """A clear error unless ``cluster`` is a started emulated cluster whose links are up and
    ``port`` a TCP port for the rendezvous."""
    if not isinstance(cluster, EmulatedCluster):
        raise TypeError(f"cluster must be an EmulatedCluster (`with EmulatedCluster(nodes=2) as "
                        f"cluster:`), got {cluster!r}")
    if not cluster.started:
        raise RuntimeError("the cluster is not started: run the agents inside `with "
                           "EmulatedCluster(...) as cluster:`")
    cluster.check_ready()
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        raise ValueError(f"port must be a TCP port from 1024 to 65535 for the rendezvous, got "
                         f"{port!r}")


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment, with our dpcourse first on the path and output unbuffered."""
    package_root = str(Path(__file__).resolve().parents[3])  # the folder that holds dpcourse/
    pythonpath = [
        package_root,
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
    ]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }


def run_torchrun_on_cluster(
    target: str | os.PathLike,
    cluster,
    args: Sequence[str | os.PathLike] = (),
    *,
    module: bool = False,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    port: int = 29400,
) -> list[subprocess.CompletedProcess]:
    """One ``torchrun`` agent per node of a started
    :class:`~dpcourse.harness.cluster.EmulatedCluster`, each inside its node and starting
    ``cluster.ranks_per_node`` ranks, meeting at a c10d rendezvous hosted by node 0's agent
    over the emulated network, as ``srun torchrun ...`` does on a SLURM cluster (chapter 8).
    Returns each node's finished agent, node 0 first. After ``timeout`` seconds every agent is
    killed and ``subprocess.TimeoutExpired`` raised."""
    check_cluster(cluster, port)
    check_options(timeout)
    head = cluster.nodes[0].address
    agents = []
    for node in range(cluster.nodes_count):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={cluster.nodes_count}", f"--nproc-per-node={cluster.ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}", "--rdzv-id=dpcourse",
            f"--local-addr={cluster.nodes[node].address}", "--monitor-interval=0.2",
            # node 0 hosts the store: torchrun would look for the endpoint among the machine's
            # host names, and the emulated addresses are not among them
            f"--rdzv-conf=is_host={int(node == 0)}",
            *(["-m", str(target)] if module else [str(target)]),
            *(str(a) for a in args),
        ]  # fmt: skip
        node_env = _environment({"GLOO_SOCKET_IFNAME": "eth0", **(env or {})})
        agents.append(subprocess.Popen(cluster.command(node, *cmd), env=node_env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    deadline = time.monotonic() + timeout
    try:
        outputs = [agent.communicate(timeout=max(0.1, deadline - time.monotonic()))
                   for agent in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            agent.kill()
            agent.communicate()
        raise
    return [subprocess.CompletedProcess(a.args, a.returncode, out, err)
            for a, (out, err) in zip(agents, outputs, strict=True)]
