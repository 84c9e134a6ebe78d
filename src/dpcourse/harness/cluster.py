"""An emulated cluster on one machine: nodes joined by real, rate-limited network links.

On one box every rank talks to every other through loopback memory: all all-reduce algorithms
look alike and latency is microseconds, so the course's claims about networks (the naive
all-reduce slows down with N while the ring does not, overlap hides a slow link, a two-level
all-reduce pays when the links between nodes are slower than inside them) could only be shown
as formulas. Linux can emulate the network instead::

    with EmulatedCluster(nodes=4, link="1gbit") as cluster:
        run_ranks(work, 4, cluster=cluster)   # rank r runs on node r, over 1 Gbit/s links

Each node is a **network namespace** (its own interfaces, addresses and loopback), joined to a
**bridge** (a virtual switch) in the caller's namespace by a **veth pair** (a virtual cable).
Both ends of every cable are shaped by ``tc``'s token-bucket filter (``tbf``) to ``link``, so
a node sends and receives at that rate at once, as a full-duplex network card does, and the
bridge forwards between nodes without a limit of its own, as a non-blocking switch. The ranks
of one node (``ranks_per_node``) share its namespace and talk over its loopback, unshaped unless
``node_link`` is given (the fast links inside a node). Ranks are node-major, as torchrun and
Slurm number them: ranks 0..k-1 on node 0, and so on. gloo is bound to each node's ``eth0``
and the rendezvous store, hosted by the caller, is reached over the bridge. The emulation has
bandwidth but no added latency (this kernel has no ``netem``): a message's fixed cost stays
that of the software, tens of microseconds.

While ranks run, the cluster can break its own network (chapter 8): ``slow_link(node, rate)``
makes a straggler node, ``cut_link(node)`` takes its cable down, ``restore_link(node)`` brings it
back at the cluster's rate, ``kill_node(node)`` kills every process inside the node; each now,
``at_step=`` (the ranks call :func:`fault_point` in their loop), ``after=`` seconds or
``when=`` a condition. A run that fails after a fault raises its usual error, with a report of
the fault first: the node lost, the collective each rank was in, what each saw
(:mod:`dpcourse.harness.faults`). ``collective_timeout`` bounds how long a rank's collective
waits for a peer that went silent (the process group's timeout), and ``heal()`` or closing the
cluster undoes every fault.

Needs root (or the capability ``CAP_NET_ADMIN``) and iproute2's ``ip`` and ``tc``; without them
:class:`EmulatedCluster` raises :class:`ClusterUnavailable`, which says what is missing. What
it creates carries the caller's process id in its name (``dpc<pid><letter>``) and is removed
on exit, also after an exception or a dead rank; what a killed caller leaves behind is removed
by the next cluster that starts.

Chapter 0: the course-wide runtime (the emulated cluster of chapters 6, 7, 8 and 10).
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dpcourse.cost.hardware import rate_bits
from dpcourse.harness.faults import FAULT_DIR, Fault, FaultSchedule, fault_point, fault_report
from dpcourse.harness.netns import (
    PREFIX,
    ClusterUnavailable,
    check_available,
    ip,
    remove,
    remove_stale,
)

__all__ = ["EmulatedCluster", "ClusterUnavailable", "check_available", "Fault", "fault_point"]

_LOCK_FILE = "/run/dpcourse-cluster.lock"  # taken while namespaces and subnets are handed out
_SUBNET = "10.213.{}"  # one 10.213.x.0/24 per live cluster, the first free x
_live: list[EmulatedCluster] = []
_live_lock = threading.Lock()
_letters = itertools.cycle("abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True)
class Node:
    """One emulated machine: its namespace, its address on the bridge."""

    index: int
    namespace: str
    address: str

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.namespace}"


class EmulatedCluster:
    """``nodes`` emulated machines of ``ranks_per_node`` ranks each, joined by links of rate
    ``link`` (see the module); ``node_link`` shapes the loopback inside each node.

    A context manager: the namespaces, cables, bridge and shaping exist between ``__enter__``
    (or :meth:`start`) and ``__exit__`` (or :meth:`close`). Pass it to
    :func:`dpcourse.harness.launch.run_ranks` or :class:`~dpcourse.harness.launch.RankPool` as
    ``cluster=`` with ``world_size == nodes * ranks_per_node``; pools on it are closed when it
    closes.
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int = 1,
        link: str = "1gbit",
        node_link: str | None = None,
        collective_timeout: float | None = None,
    ):
        for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an int from 1 to 64, got {value!r}")
        if collective_timeout is not None and (
            isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float))
            or not collective_timeout > 0
        ):
            raise ValueError(
                "collective_timeout must be a number of seconds above 0 (how long a collective "
                f"waits for a silent peer), or None for the course's default; got "
                f"{collective_timeout!r}"
            )
        self.nodes_count = nodes
        self.ranks_per_node = ranks_per_node
        self.link = link
        self.link_bits = rate_bits(link, "link")
        self.node_link = node_link
        self.node_link_bits = rate_bits(node_link, "node_link") if node_link is not None else None
        self.collective_timeout = collective_timeout
        self.tag = ""
        self.nodes: list[Node] = []
        self.store_address = ""
        self.faults: list[Fault] = []  # applied, in order (cleared when the cluster closes)
        self._pools: list = []
        self._schedule: FaultSchedule | None = None
        self._control_dir = ""
        self._cut: set[int] = set()  # nodes whose link is down
        self._slowed: dict[int, str] = {}  # nodes whose link runs at another rate
        self._fault_lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self.nodes_count * self.ranks_per_node

    @property
    def started(self) -> bool:
        return bool(self.nodes)

    def __repr__(self) -> str:
        inside = f", node_link={self.node_link!r}" if self.node_link else ""
        state = f"tag={self.tag!r}" if self.started else "not started"
        return (f"EmulatedCluster(nodes={self.nodes_count}, ranks_per_node={self.ranks_per_node}, "
                f"link={self.link!r}{inside}, {state})")

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> EmulatedCluster:
        """Build the nodes, cables, bridge and shaping (removing stale ones first)."""
        if self.started:
            return self
        check_available()
        with open(_LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            remove_stale()
            self.tag = f"{PREFIX}{os.getpid()}{next(_letters)}"
            remove(self.tag)  # a cluster of this process with the same letter, not closed
            subnet = self._free_subnet()
            try:
                self._build(subnet)
            except BaseException:
                remove(self.tag)
                self.nodes = []
                raise
        self._control_dir = tempfile.mkdtemp(prefix="dpcourse-faults-")
        self._schedule = FaultSchedule(self._apply, self._control_dir)
        with _live_lock:
            _live.append(self)
        return self

    def close(self) -> None:
        """Close the pools running on the cluster, disarm its faults, kill whatever still runs
        inside its nodes (torchrun agents, their workers), then remove everything it created."""
        if self._schedule is not None:
            self._schedule.stop()
            self._schedule = None
        for pool in list(self._pools):
            pool.close()
        self._pools.clear()
        for node in self.nodes:
            self._kill_processes(node.namespace)
        if self.tag:
            remove(self.tag)
        if self._control_dir:
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self._control_dir = ""
        self.nodes = []
        self.faults = []
        self._cut.clear()
        self._slowed.clear()
        with _live_lock:
            if self in _live:
                _live.remove(self)

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _free_subnet(self) -> str:
        used = ip("ip", "-o", "-4", "addr", "show", check=False)
        for third in range(256):
            if f" {_SUBNET.format(third)}." not in used:
                return f"{_SUBNET.format(third)}.0/24"
        raise ClusterUnavailable("no free 10.213.x.0/24 subnet: close other emulated clusters")

    def _shape(self, device: str, rate_bits_: float, namespace: str | None = None) -> None:
        # The bucket must hold a packet as the device hands it over, or tbf drops it and the
        # connection stalls: veth passes segments of up to 64 KiB, loopback's MTU is 64 KiB.
        # Beyond that, 1 ms at the rate. (A message smaller than the bucket can pass at once.)
        burst = max(128 * 1024, int(rate_bits_ / 8 / 1000))
        where = ["-n", namespace] if namespace else []
        ip("tc", *where, "qdisc", "replace", "dev", device, "root", "tbf",
            "rate", f"{int(rate_bits_)}bit", "burst", str(burst), "latency", "200ms")

    def _build(self, subnet: str) -> None:
        base = subnet.rsplit(".", 1)[0]
        bridge = f"{self.tag}br"
        ip("ip", "link", "add", bridge, "type", "bridge")
        ip("ip", "addr", "add", f"{base}.254/24", "dev", bridge)
        ip("ip", "link", "set", bridge, "up")
        self.store_address = f"{base}.254"
        for i in range(self.nodes_count):
            ns, host_end, node_end = f"{self.tag}n{i}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            address = f"{base}.{i + 1}"
            ip("ip", "netns", "add", ns)
            ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            ip("ip", "link", "set", node_end, "netns", ns)
            ip("ip", "-n", ns, "link", "set", node_end, "name", "eth0")
            ip("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("ip", "-n", ns, "link", "set", "eth0", "up")
            ip("ip", "-n", ns, "link", "set", "lo", "up")
            ip("ip", "link", "set", host_end, "master", bridge, "up")
            self._shape(host_end, self.link_bits)  # into the node
            self._shape("eth0", self.link_bits, ns)  # out of the node
            if self.node_link_bits is not None:
                self._shape("lo", self.node_link_bits, ns)
            self.nodes.append(Node(i, ns, address))

    # -- what the launcher asks -------------------------------------------------------------
    def node_of(self, rank: int) -> Node:
        """The node that rank ``rank`` runs on (node-major)."""
        return self.nodes[rank // self.ranks_per_node]

    def check_world_size(self, world_size: int) -> None:
        """A clear error unless ``world_size`` ranks fill the cluster exactly."""
        if world_size != self.world_size:
            raise ValueError(
                f"world_size {world_size} does not fit {self.nodes_count} node(s) of "
                f"{self.ranks_per_node} rank(s): run {self.world_size} ranks on this cluster, "
                "or make one whose nodes * ranks_per_node == "
                f"{world_size}"
            )
        if not self.started:
            raise RuntimeError(
                "the cluster is not started: use it as `with EmulatedCluster(...) as cluster:`"
            )

    def rank_environment(self, rank: int) -> dict[str, str]:
        """The environment of rank ``rank``: its node's namespace (the worker enters it before
        anything else), gloo bound to the node's interface, torchrun's local-rank variables, the
        collective timeout and the folder of the fault points."""
        node = self.node_of(rank)
        env = {
            "DPCOURSE_NETNS": node.netns_path,
            "GLOO_SOCKET_IFNAME": "eth0",
            "MASTER_ADDR": self.store_address,
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node.index),
            FAULT_DIR: self._control_dir,
        }
        if self.collective_timeout is not None:
            env["DPCOURSE_GROUP_TIMEOUT"] = str(self.collective_timeout)
        return env

    def check_ready(self) -> None:
        """A clear error if new ranks could not start: a node whose link is cut cannot reach the
        rendezvous store (the launcher calls this before it starts ranks)."""
        if self._cut:
            nodes = sorted(self._cut)
            raise RuntimeError(
                f"the link of node(s) {nodes} is cut: ranks there cannot reach the others. "
                "Call " + " and ".join(f"cluster.restore_link({n})" for n in nodes)
                + " (or cluster.heal()) before starting ranks"
            )

    def command(self, node: int, *argv: str) -> list[str]:
        """``argv`` as a command line that runs inside node ``node`` (``ip netns exec``), for
        programs started by hand there, such as chapter 8's torchrun agents."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]


    # -- faults (chapter 8) ------------------------------------------------------------------
    def slow_link(
        self,
        node: int,
        rate: str,
        *,
        at_step: int | None = None,
        after: float | None = None,
        when: Callable[[], bool] | None = None,
    ) -> Fault:
        """Shape node ``node``'s cable (both directions) to ``rate`` (``"100mbit"``): a straggler
        node, whose every collective runs at that pace. Now, or at the trigger given (see
        :meth:`cut_link`). Undone by :meth:`restore_link`, :meth:`heal` or closing."""
        bits = rate_bits(rate, "rate")
        return self._fault(Fault("slow", self._node_index(node), detail=f"link slowed to {rate}"),
                           at_step, after, when, bits=bits, rate=rate)

    def cut_link(
        self,
        node: int,
        *,
        at_step: int | None = None,
        after: float | None = None,
        when: Callable[[], bool] | None = None,
    ) -> Fault:
        """Take node ``node``'s cable down, as a pulled cable or a lost switch port: nothing
        crosses it either way, and no connection is closed (the peers' packets go unanswered).

        Now, or when the ranks reach step ``at_step`` (they call :func:`fault_point` in their
        loop), ``after`` seconds from now, or as soon as ``when()`` returns true (polled every
        5 ms: a checkpoint written, a line logged). Returns the :class:`Fault`, whose
        ``wait()`` blocks until it is applied. Undone by :meth:`restore_link`, :meth:`heal` or
        closing the cluster."""
        return self._fault(Fault("cut", self._node_index(node), detail="link cut"),
                           at_step, after, when)

    def restore_link(
        self,
        node: int,
        *,
        at_step: int | None = None,
        after: float | None = None,
        when: Callable[[], bool] | None = None,
    ) -> Fault:
        """Bring node ``node``'s cable back, up and at the cluster's ``link`` rate (the end of a
        cut or a slow link); connections that were waiting go on where TCP's retransmissions
        pick them up. Now, or at the trigger given (see :meth:`cut_link`)."""
        return self._fault(Fault("restore", self._node_index(node),
                                 detail=f"link restored at {self.link}"),
                           at_step, after, when)

    def kill_node(
        self,
        node: int,
        *,
        at_step: int | None = None,
        after: float | None = None,
        when: Callable[[], bool] | None = None,
    ) -> Fault:
        """SIGKILL every process inside node ``node`` (its ranks, a torchrun agent and its
        workers), as a machine that loses power: the kernel closes their connections, so the
        peers hear of it at once. Now, or at the trigger given (see :meth:`cut_link`). The
        node's network stays: new ranks can start there."""
        return self._fault(Fault("kill", self._node_index(node), detail="processes killed"),
                           at_step, after, when)

    def heal(self) -> list[Fault]:
        """Restore every link that is cut or slowed, now, and disarm the faults not yet applied;
        returns the restores done."""
        if self._schedule is not None:
            self._schedule.stop()
        return [self.restore_link(n) for n in sorted(self._cut | set(self._slowed))]

    def link_cut(self, node: int) -> bool:
        """Whether node ``node``'s link is down now."""
        return self._node_index(node) in self._cut

    def faults_since(self, moment: float) -> list[Fault]:
        """The faults applied at or after ``time.monotonic()`` == ``moment``, and the cuts and
        slow links still in effect from before it."""
        return [f for f in self.faults if f.applied_at is not None and (
            f.applied_at >= moment
            or (f.kind == "cut" and f.node in self._cut)
            or (f.kind == "slow" and f.node in self._slowed))]

    def explain(self, error, since: float) -> None:
        """Put the story of the faults applied since ``since`` (``time.monotonic()``) at the
        head of ``error``, a :class:`dpcourse.harness.launch.RankError` raised by a run on this
        cluster (the launcher calls this); nothing where no fault happened."""
        faults = self.faults_since(since)
        report = fault_report(
            error, faults, lambda r: self.node_of(r).index if self.nodes else r
            // self.ranks_per_node, {n.address: n.index for n in self.nodes},
            self.collective_timeout, lambda n: n in self._cut,
        )
        if report:
            error.context = report
            error.lost_nodes = sorted({f.node for f in faults if f.kind in ("cut", "kill")})
            error.faults = faults

    def _node_index(self, node: int) -> int:
        if not isinstance(node, int) or isinstance(node, bool) or not (
            0 <= node < self.nodes_count
        ):
            raise ValueError(
                f"node must be the index of one of the cluster's {self.nodes_count} nodes, an "
                f"int from 0 to {self.nodes_count - 1}; got {node!r}"
            )
        return node

    def _fault(self, fault: Fault, at_step, after, when, **how) -> Fault:
        given = [name for name, value in (("at_step", at_step), ("after", after), ("when", when))
                 if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one trigger of at_step, after and when, not {given}")
        if at_step is not None and (not isinstance(at_step, int) or isinstance(at_step, bool)
                                    or at_step < 0):
            raise ValueError(f"at_step must be a step number (an int from 0), got {at_step!r}")
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                  or after < 0):
            raise ValueError(f"after must be a number of seconds from 0, got {after!r}")
        if when is not None and not callable(when):
            raise ValueError(f"when must be a function of no arguments that returns True when "
                             f"the fault is due, got {when!r}")
        if not self.started or self._schedule is None:
            raise RuntimeError("the cluster is not started: inject faults inside "
                               "`with EmulatedCluster(...) as cluster:`")
        fault.how = how
        if not given:
            self._apply(fault)
            fault.done.set()
            return fault
        return self._schedule.arm(fault, at_step=at_step, after=after, when=when)

    def _apply(self, fault: Fault) -> None:
        """Do ``fault`` now (from the caller, or from the schedule's thread)."""
        node = self.nodes[fault.node]
        host_end = f"{self.tag}v{fault.node}"
        with self._fault_lock:
            if fault.kind == "slow":
                self._shape(host_end, fault.how["bits"])
                self._shape("eth0", fault.how["bits"], node.namespace)
                self._slowed[fault.node] = fault.how["rate"]
            elif fault.kind == "cut":
                ip("ip", "link", "set", host_end, "down")  # the node's eth0 loses its carrier
                self._cut.add(fault.node)
            elif fault.kind == "restore":
                ip("ip", "link", "set", host_end, "up")
                self._shape(host_end, self.link_bits)
                self._shape("eth0", self.link_bits, node.namespace)
                self._cut.discard(fault.node)
                self._slowed.pop(fault.node, None)
            elif fault.kind == "kill":
                killed = self._kill_processes(node.namespace)
                fault.detail = f"{killed} process{'es' if killed != 1 else ''} killed"  # how many
            fault.applied_at = time.monotonic()
            self.faults.append(fault)

    @staticmethod
    def _kill_processes(namespace: str) -> int:
        """SIGKILL every process in ``namespace`` and wait (up to 10 s) until none is left;
        returns how many there were."""
        killed: set[int] = set()
        deadline = time.monotonic() + 10
        while True:
            pids = {int(p) for p in ip("ip", "netns", "pids", namespace, check=False).split()}
            pids.discard(os.getpid())
            if not pids or time.monotonic() > deadline:
                return len(killed)
            for pid in pids - killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed |= pids
            time.sleep(0.02)


@atexit.register
def _close_live_clusters() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception:
            pass
