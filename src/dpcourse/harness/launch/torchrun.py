"""Run a script or a module under ``torchrun`` in a subprocess and wait for it.

:func:`run_torchrun` is the one harness for it: the tests start the command-line trainer and
small scripts with it, the way chapter 8 starts ``python -m dpcourse.practice.train``. It runs
``python -m torch.distributed.run --standalone`` (``torchrun``, from the same Python), so it
needs no ``torchrun`` on the ``PATH``, and the ranks import the same ``dpcourse`` as the caller.
On an emulated cluster, :class:`TorchrunAgents` starts one agent per node (and replacements for
agents that died) and :func:`run_torchrun_on_cluster` starts them and waits (chapter 8).

Chapter 0: the course-wide launcher's plumbing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dpcourse.harness.cluster import EmulatedCluster

__all__ = ["run_torchrun", "run_torchrun_on_cluster", "TorchrunAgents"]


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
    _check_target(target, module)
    _check_options(timeout, max_restarts)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.2",
        *(["-m", str(target)] if module else [str(target)]),
        *(str(a) for a in args),
    ]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_environment(env), cwd=cwd
    )


def _check_target(target: str | os.PathLike, module: bool) -> None:
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


def _check_options(timeout: float, max_restarts: int = 0) -> None:
    """A clear error for a timeout that is not a positive number of seconds or a number of
    restarts that is not an int from 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds above 0, got {timeout!r}")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int from 0 (how often torchrun restarts the "
                         f"workers after a failure), got {max_restarts!r}")


def _check_cluster(cluster, port: int) -> None:
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


class TorchrunAgents:
    """``torchrun`` agents on the nodes of a started
    :class:`~dpcourse.harness.cluster.EmulatedCluster`, one per node, each inside its node and
    starting ``cluster.ranks_per_node`` workers, meeting at a c10d rendezvous hosted by node 0's
    agent over the emulated network, as ``srun torchrun ...`` does on a SLURM cluster
    (chapter 8). :func:`run_torchrun_on_cluster` starts them and waits; this class lets the
    caller act while they run: inject a fault, start a replacement agent on a node whose agent
    died (:meth:`start` with the node), read what each agent has written so far.

    ``nnodes`` is torchrun's: ``"2"`` (the default: every node), or ``"1:2"`` for an elastic job
    that goes on with fewer nodes; ``max_restarts`` how often an agent restarts its workers
    after a failure; ``rdzv_conf`` more of the c10d rendezvous' settings (``join_timeout``,
    ``last_call_timeout``, in seconds). Each agent is a session of its own, so that
    :meth:`kill` ends it with its workers. Node 0's agent hosts the rendezvous store: losing
    node 0 loses the rendezvous, and the job cannot recover (a store outside the nodes, such as
    etcd, can).
    """

    def __init__(
        self,
        target: str | os.PathLike,
        cluster,
        args: Sequence[str | os.PathLike] = (),
        *,
        module: bool = False,
        nnodes: str | None = None,
        max_restarts: int = 0,
        env: Mapping[str, str] | None = None,
        port: int = 29400,
        rdzv_conf: Mapping[str, float] | None = None,
    ):
        _check_cluster(cluster, port)
        _check_target(target, module)
        _check_options(1.0, max_restarts)
        self.nnodes = str(cluster.nodes_count) if nnodes is None else nnodes
        low, _, high = self.nnodes.partition(":")
        if not (low.isdigit() and (high or low).isdigit()
                and 1 <= int(low) <= int(high or low) <= cluster.nodes_count):
            raise ValueError(f"nnodes must be torchrun's N or MIN:MAX with 1 <= MIN <= MAX <= "
                             f"the cluster's {cluster.nodes_count} nodes, got {nnodes!r}")
        self.cluster = cluster
        self.target, self.module, self.args = target, module, [str(a) for a in args]
        self.max_restarts, self.env, self.port = max_restarts, dict(env or {}), port
        self.rdzv_conf = dict(rdzv_conf or {})
        self.agents: dict[int, list[subprocess.Popen]] = {}  # every agent started, per node
        self._folder = tempfile.mkdtemp(prefix="dpcourse-agents-")
        self._files: dict[int, list[tuple[str, str]]] = {}

    def command(self, node: int) -> list[str]:
        """Node ``node``'s torchrun command line (run inside the node)."""
        conf = {"is_host": int(node == 0), **self.rdzv_conf}
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", f"--nproc-per-node={self.cluster.ranks_per_node}",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.cluster.nodes[0].address}:{self.port}",
            "--rdzv-id=dpcourse", f"--local-addr={self.cluster.nodes[node].address}",
            "--monitor-interval=0.2",
            # node 0 hosts the store: torchrun would look for the endpoint among the machine's
            # host names, and the emulated addresses are not among them
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
            *(["-m", str(self.target)] if self.module else [str(self.target)]),
            *self.args,
        ]  # fmt: skip

    def start(self, node: int | None = None) -> TorchrunAgents:
        """Start an agent on every node, or on node ``node`` alone (a replacement for one that
        died: it joins the job's next rendezvous round)."""
        for n in range(self.cluster.nodes_count) if node is None else [node]:
            path = os.path.join(self._folder, f"node{n}-{len(self.agents.get(n, []))}.log")
            with open(path, "w") as log:  # stdout and stderr in one file: lines in time order
                agent = subprocess.Popen(
                    self.cluster.command(n, *self.command(n)),
                    env=_environment({"GLOO_SOCKET_IFNAME": "eth0", **self.env}),
                    text=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
            self.agents.setdefault(n, []).append(agent)
            self._files.setdefault(n, []).append(path)
        return self

    def output(self, node: int) -> str:
        """What every agent started on node ``node`` (and its workers) has written so far,
        stdout and stderr together, agent after agent in the order they were started."""
        text = []
        for path in self._files.get(node, []):
            with open(path) as f:
                text.append(f.read())
        return "".join(text)

    def wait_for(self, text: str, node: int = 0, timeout: float = 240.0) -> float | None:
        """Wait until ``text`` appears in node ``node``'s output (:meth:`output`); return the
        ``time.monotonic()`` at which it was seen (within 50 ms), or None if every agent of the
        node ended, or ``timeout`` seconds passed, first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output(node):
                return time.monotonic()
            if all(a.poll() is not None for a in self.agents.get(node, [])):
                return time.monotonic() if text in self.output(node) else None
            time.sleep(0.05)
        return None

    def wait(self, timeout: float = 240.0) -> list[subprocess.CompletedProcess]:
        """Wait for the last agent of each node; return them, node 0 first (``stdout`` holds
        what every agent of that node wrote, replaced ones first, with their stderr; ``stderr``
        is empty). After ``timeout``
        seconds every agent is killed and ``subprocess.TimeoutExpired`` raised."""
        _check_options(timeout)
        deadline = time.monotonic() + timeout
        try:
            for node in sorted(self.agents):
                self.agents[node][-1].wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        return [subprocess.CompletedProcess(self.agents[node][-1].args,
                                            self.agents[node][-1].returncode,
                                            self.output(node), "")
                for node in sorted(self.agents)]

    def kill(self) -> None:
        """Kill every agent still running, with its workers."""
        for agents in self.agents.values():
            for agent in agents:
                if agent.poll() is None:
                    try:
                        os.killpg(agent.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    agent.wait()

    def close(self) -> None:
        """Kill what still runs and remove the output files."""
        self.kill()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> TorchrunAgents:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def run_torchrun_on_cluster(
    target: str | os.PathLike,
    cluster,
    args: Sequence[str | os.PathLike] = (),
    *,
    module: bool = False,
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    port: int = 29400,
    nnodes: str | None = None,
    max_restarts: int = 0,
) -> list[subprocess.CompletedProcess]:
    """One ``torchrun`` agent per node of a started
    :class:`~dpcourse.harness.cluster.EmulatedCluster` (:class:`TorchrunAgents`), started and
    waited for: returns each node's finished agent, node 0 first. After ``timeout`` seconds
    every agent is killed and ``subprocess.TimeoutExpired`` raised."""
    _check_cluster(cluster, port)
    _check_options(timeout, max_restarts)
    with TorchrunAgents(target, cluster, args, module=module, env=env, port=port,
                        nnodes=nnodes, max_restarts=max_restarts) as agents:
        return agents.wait(timeout)
