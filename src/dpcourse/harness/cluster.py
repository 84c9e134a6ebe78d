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
import threading
from dataclasses import dataclass

from dpcourse.cost.hardware import rate_bits
from dpcourse.harness.netns import (
    PREFIX,
    ClusterUnavailable,
    check_available,
    ip,
    remove,
    remove_stale,
)

__all__ = ["EmulatedCluster", "ClusterUnavailable", "check_available"]

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
    ):
        for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                raise ValueError(f"{name} must be an int from 1 to 64, got {value!r}")
        self.nodes_count = nodes
        self.ranks_per_node = ranks_per_node
        self.link = link
        self.link_bits = rate_bits(link)
        self.node_link = node_link
        self.node_link_bits = rate_bits(node_link) if node_link is not None else None
        self.tag = ""
        self.nodes: list[Node] = []
        self.store_address = ""
        self._pools: list = []

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
        with _live_lock:
            _live.append(self)
        return self

    def close(self) -> None:
        """Close the pools running on the cluster, then remove everything it created."""
        for pool in list(self._pools):
            pool.close()
        self._pools.clear()
        if self.tag:
            remove(self.tag)
        self.nodes = []
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
        anything else), gloo bound to the node's interface, torchrun's local-rank variables."""
        node = self.node_of(rank)
        return {
            "DPCOURSE_NETNS": node.netns_path,
            "GLOO_SOCKET_IFNAME": "eth0",
            "MASTER_ADDR": self.store_address,
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "GROUP_RANK": str(node.index),
        }

    def command(self, node: int, *argv: str) -> list[str]:
        """``argv`` as a command line that runs inside node ``node`` (``ip netns exec``), for
        programs started by hand there, such as chapter 8's torchrun agents."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]


@atexit.register
def _close_live_clusters() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception:
            pass
