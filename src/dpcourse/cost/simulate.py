"""A simulated network: the course's collective code on many virtual ranks.

Real ranks are processes; a machine runs a handful. Here each virtual rank is a thread, and the
message layer of :mod:`dpcourse.collectives.p2p` hands its sends and receives to a
:class:`SimulatedNetwork` instead of torch.distributed. The collectives themselves are not
re-implemented: ``ring_all_reduce`` runs exactly as on real ranks, moving real (small) tensors.

Time is simulated. Every rank has a clock, an outgoing and an incoming link. A message of ``b``
bytes can start once both sides have posted it and both links are free; it then takes
``alpha + b * bytes_scale / beta`` seconds and occupies both links. A rank that waits for a
message moves its clock to the message's arrival. ``bytes_scale`` lets a tensor of a few
elements stand for a gradient of a gigabyte: the data that moves is small, the bytes that are
charged are large. The simulation agrees with the alpha-beta formulas of
:mod:`dpcourse.cost.costmodel`
(tested), and also shows what they leave out where the code deviates from them. Chapter 10
uses it too (a slow link).

Chapter 6: a simulated network that runs the collectives on many virtual ranks.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dpcourse import collectives as C
from dpcourse.collectives import p2p

__all__ = ["SimulatedNetwork", "SimResult", "run", "all_reduce_time"]


@dataclass
class _Ticket:
    kind: str  # "send" or "recv"
    rank: int  # the rank that posted it
    peer: int
    tensor: torch.Tensor
    posted_at: float
    done: threading.Event = field(default_factory=threading.Event)
    finish: float = 0.0
    error: Exception | None = None


class SimulatedNetwork:
    """Links of latency ``alpha`` (s) and bandwidth ``beta`` (bytes/s) between every pair.

    ``link_beta`` gives some directed links ``(src, dst)`` a bandwidth of their own, e.g. one
    slow cable (chapter 10: a ring is only as fast as its slowest link).
    """

    def __init__(
        self,
        world_size: int,
        alpha: float,
        beta: float,
        bytes_scale: float = 1.0,
        link_beta: dict[tuple[int, int], float] | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size, self.alpha, self.beta, self.bytes_scale = (
            world_size,
            alpha,
            beta,
            bytes_scale,
        )
        self.link_beta = dict(link_beta or {})
        for (src, dst), b in self.link_beta.items():
            self._check_peer(src, dst)
            if not b > 0:
                raise ValueError(f"link ({src}, {dst}) needs a bandwidth > 0, got {b}")
        self.clock = [0.0] * world_size
        self.out_free = [0.0] * world_size
        self.in_free = [0.0] * world_size
        self.messages = 0
        self.bytes = 0.0
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int], deque[_Ticket]] = {}
        self._recvs: dict[tuple[int, int], deque[_Ticket]] = {}

    def post_send(self, rank: int, dst: int, tensor: torch.Tensor) -> _Ticket:
        self._check_peer(rank, dst)
        ticket = _Ticket("send", rank, dst, tensor, self.clock[rank])
        with self._lock:
            waiting = self._recvs.get((rank, dst))
            if waiting:
                self._deliver(ticket, waiting.popleft())
            else:
                self._sends.setdefault((rank, dst), deque()).append(ticket)
        return ticket

    def post_recv(self, rank: int, src: int, tensor: torch.Tensor) -> _Ticket:
        self._check_peer(rank, src)
        ticket = _Ticket("recv", rank, src, tensor, self.clock[rank])
        with self._lock:
            waiting = self._sends.get((src, rank))
            if waiting:
                self._deliver(waiting.popleft(), ticket)
            else:
                self._recvs.setdefault((src, rank), deque()).append(ticket)
        return ticket

    def wait(self, rank: int, ticket: _Ticket, timeout: float = 120.0) -> None:
        if not ticket.done.wait(timeout):
            raise TimeoutError(
                f"virtual rank {rank} waited {timeout:g} s (real time) for a {ticket.kind} "
                f"{'to' if ticket.kind == 'send' else 'from'} rank {ticket.peer}: a deadlock?"
            )
        if ticket.error is not None:
            raise ticket.error
        self.clock[rank] = max(self.clock[rank], ticket.finish)

    def _deliver(self, send: _Ticket, recv: _Ticket) -> None:
        if send.tensor.numel() != recv.tensor.numel():
            error = ValueError(
                f"rank {send.rank} sends {send.tensor.numel()} elements but rank "
                f"{recv.rank} expects {recv.tensor.numel()}"
            )
            for ticket in (send, recv):  # both sides fail, neither waits forever
                ticket.error = error
                ticket.done.set()
            return
        nbytes = send.tensor.numel() * send.tensor.element_size() * self.bytes_scale
        src, dst = send.rank, recv.rank
        start = max(send.posted_at, recv.posted_at, self.out_free[src], self.in_free[dst])
        finish = start + self.alpha + nbytes / self.link_beta.get((src, dst), self.beta)
        self.out_free[src] = self.in_free[dst] = finish
        self.messages += 1
        self.bytes += nbytes
        recv.tensor.copy_(send.tensor)
        send.finish = recv.finish = finish
        send.done.set()
        recv.done.set()

    def _check_peer(self, rank: int, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == rank:
            raise ValueError(
                f"rank {rank} cannot message rank {peer} in a world of {self.world_size}"
            )


@dataclass
class SimResult:
    results: list  # what fn returned on each virtual rank
    times: list[float]  # each rank's simulated clock at the end (s)
    network: SimulatedNetwork

    @property
    def time(self) -> float:
        """When the last rank finished (simulated seconds)."""
        return max(self.times)


def run(
    fn: Callable,
    world_size: int,
    *args: Any,
    alpha: float = 5e-6,
    beta: float = 12.5e9,
    bytes_scale: float = 1.0,
    link_beta: dict[tuple[int, int], float] | None = None,
    timeout: float = 600.0,
    **kwargs: Any,
) -> SimResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` virtual ranks of a simulated network.

    Inside ``fn``, the course's collectives (and :mod:`dpcourse.collectives.p2p`) see the
    virtual rank and world size; torch.distributed itself is not available. The collectives'
    shape check runs over the simulated links too, and costs one message per rank of simulated
    time: pass ``check_shapes=False`` to time the algorithm alone.
    ``link_beta`` maps directed links ``(src, dst)`` to a bandwidth other than ``beta``.
    """
    net = SimulatedNetwork(world_size, alpha, beta, bytes_scale, link_beta)
    results: list = [None] * world_size
    errors: list[tuple[int, str]] = []

    def body(rank: int) -> None:
        with p2p.on_simulated_network(net, rank):
            try:
                results[rank] = fn(*args, **kwargs)
            except BaseException as exc:  # reported below, with the rank
                errors.append((rank, "".join(traceback.format_exception(exc))))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads) and not errors:
        raise TimeoutError(f"the simulation of {world_size} ranks did not finish in {timeout:g} s")
    if errors:
        rank, text = min(errors)
        raise RuntimeError(f"virtual rank {rank} of {world_size} failed:\n{text}")
    return SimResult(results, list(net.clock), net)


def all_reduce_time(
    algorithm: str,
    world_size: int,
    nbytes: float,
    alpha: float = 5e-6,
    beta: float = 12.5e9,
    link_beta: dict[tuple[int, int], float] | None = None,
) -> float:
    """Simulated seconds of one all-reduce of ``nbytes`` bytes with the course's ``algorithm``
    ("ring", "tree" or "naive") on ``world_size`` ranks: the arguments of
    :func:`dpcourse.cost.costmodel.all_reduce_time`, which it agrees with (tested). The code runs on
    one float32 element per rank (so the ring's chunks are equal), each charged as
    ``nbytes / world_size`` bytes.
    ``link_beta``: bandwidths of particular directed links, as in :class:`SimulatedNetwork`."""

    fn = C.ALL_REDUCES[algorithm]

    def one_rank():
        rank, world = p2p.rank_and_size()
        x = torch.full((world,), float(rank))
        fn(x, check_shapes=False)
        return x[0].item()

    result = run(
        one_rank,
        world_size,
        alpha=alpha,
        beta=beta,
        bytes_scale=nbytes / (4 * world_size),
        link_beta=link_beta,
    )
    expected = world_size * (world_size - 1) / 2
    if any(r != expected for r in result.results):  # the code really ran: check its answer
        raise AssertionError(f"{algorithm} all-reduce computed a wrong sum in the simulation")
    return result.time
