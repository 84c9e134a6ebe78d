"""The message layer every collective of the course is built on: point-to-point sends.

Chapters 5 and 6 build broadcast, reduce and all-reduce out of nothing but ``send`` and
``recv`` between pairs of ranks. Everything they send goes through this module, which

* **counts** the bytes and messages each rank sends and receives (:func:`count_traffic`), so the
  chapters can check the formulas: the ring sends 2(N-1)/N of the data per rank, whatever N;
* **posts receives before sends** (:func:`exchange`, :func:`irecv`): gloo moves data only once
  the receiver has posted its receive, so "everyone sends, then everyone receives" would
  deadlock on a ring, and a receive posted early spares the sender a round trip to ask for it;
* sends CUDA tensors GPU to GPU with NCCL; over gloo, whose send and recv take host tensors
  only (ranks that share a GPU), the runtime has torch.distributed's point-to-point functions copy
  them through host memory (:mod:`dpcourse.shared_gpu`), for this module and for code that calls
  ``dist.send`` itself, and this module stages its own messages also where torch's
  ``init_process_group`` started the group without the runtime (CS336's tests do);
* can be pointed at a **simulated network** instead of torch.distributed
  (:mod:`dpcourse.cost.simulate`), so that the same collective code runs on thousands of virtual
  ranks with links of a chosen latency and bandwidth.

Chapter 5: point-to-point messages, the layer every collective is built on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpcourse import shared_gpu
from dpcourse.stand_in import stand_in

__all__ = [
    "Traffic",
    "count_traffic",
    "counted_like",
    "active_counters",
    "not_counted",
    "send",
    "recv",
    "isend",
    "irecv",
    "Handle",
    "Waitable",
    "exchange",
    "posts_ahead",
    "rank_and_size",
    "simulated_network",
    "on_simulated_network",
]


@dataclass
class Traffic:
    """What one rank sent and received while :func:`count_traffic` was active."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (send/recv, peer, bytes)


# Per thread: the virtual ranks of a simulation are threads of one process, each with its own.
_counting = threading.local()
# And per process, for threads that never counted: on a GPU, autograd runs backward and its
# hooks on a thread of its own (chapter 9's FSDP launches its gathers and reduce-scatters from
# there), whose messages belong to the rank's count all the same.
_process_counters: list[Traffic] = []


def _active() -> list[Traffic]:
    active = getattr(_counting, "active", None)
    return _process_counters if active is None else active
# Set per thread by dpcourse.cost.simulate: that thread is a virtual rank of a simulated network.
_simulated = threading.local()


def _network():
    return getattr(_simulated, "network", None)


def simulated_network():
    """The simulated network this thread runs on as one of its ranks (chapter 6's
    :class:`dpcourse.cost.simulate.SimulatedNetwork`), or None: messages go to torch.distributed."""
    return _network()


@contextlib.contextmanager
def on_simulated_network(network, rank: int) -> Iterator[None]:
    """Inside the block this thread is rank ``rank`` of ``network``: its messages travel over the
    simulated links instead of torch.distributed (:func:`dpcourse.cost.simulate.run` uses it)."""
    _simulated.network, _simulated.rank = network, rank
    try:
        yield
    finally:
        _simulated.network = None


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count this rank's point-to-point traffic inside the ``with`` block."""
    traffic = Traffic()
    if not hasattr(_counting, "active"):
        _counting.active = []
    _counting.active.append(traffic)
    _process_counters.append(traffic)
    try:
        yield traffic
    finally:
        _counting.active.remove(traffic)
        _process_counters.remove(traffic)


@contextlib.contextmanager
def counted_like(counters: list[Traffic]) -> Iterator[None]:
    """Count this thread's messages inside the block into ``counters``: the list that
    ``active_counters()`` returned on another thread. Chapter 9's FSDP runs its collectives on a
    thread of their own; the caller's :func:`count_traffic` still sees them this way."""
    saved = getattr(_counting, "active", None)
    _counting.active = list(counters)
    try:
        yield
    finally:
        _counting.active = saved if saved is not None else []


def active_counters() -> list[Traffic]:
    """The :func:`count_traffic` blocks active on this thread (for :func:`counted_like`): on a
    thread that never counted (autograd's, on a GPU), those of the process."""
    return list(_active())


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Leave this rank's messages inside the ``with`` block out of :func:`count_traffic`: the
    collectives' shape check (:func:`~dpcourse.collectives.ops.check_input`) is not part of
    the algorithm whose traffic the chapters count."""
    active = getattr(_counting, "active", None)
    _counting.active = []
    try:
        yield
    finally:
        _counting.active = active if active is not None else []


def _record(kind: str, peer: int, tensor: torch.Tensor) -> None:
    active = _active()
    if not active:  # the common case, kept cheap: every message passes here
        return
    nbytes = tensor.numel() * tensor.element_size()
    for t in active:
        if kind == "send":
            t.bytes_sent += nbytes
            t.messages_sent += 1
        else:
            t.bytes_received += nbytes
            t.messages_received += 1
        t.log.append((kind, peer, nbytes))


def rank_and_size() -> tuple[int, int]:
    """This rank and the world size; a clear error outside a process group."""
    if (net := _network()) is not None:
        return _simulated.rank, net.world_size
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "no process group: the collectives run on several ranks. Call them inside a function "
            "started with dpcourse.harness.launch.run_ranks(fn, world_size), or in a script "
            "started by "
            "torchrun after dpcourse.runtime.init_process_group()."
        )
    return dist.get_rank(), dist.get_world_size()


# Every function below takes an optional ``group``: a sub-group made by ``dist.new_group``, in
# which ``dst`` and ``src`` are ranks *of that group* (chapter 10's hierarchical all-reduce runs
# rings inside nodes and across them). They are turned into global ranks here, once, so that the
# traffic log names the same rank whichever group a message went through. Not on the simulated
# network, which has no sub-groups.
def _global(peer: int, group: dist.ProcessGroup | None) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking send of ``tensor`` to rank ``dst`` (counted)."""
    dst = _global(dst, group)
    _record("send", dst, tensor)
    if (net := _network()) is not None:
        net.wait(_simulated.rank, net.post_send(_simulated.rank, dst, tensor))
        return
    _torch_p2p("send", tensor)(tensor, dst, group)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Blocking receive from rank ``src`` into ``tensor`` (counted)."""
    src = _global(src, group)
    _record("recv", src, tensor)
    if (net := _network()) is not None:
        net.wait(_simulated.rank, net.post_recv(_simulated.rank, src, tensor))
        return
    _torch_p2p("recv", tensor)(tensor, src, group)


class Handle:
    """A posted send or receive on the simulated network, which torch.distributed's own handle
    (``dist.Work``) cannot stand for. ``wait()`` blocks until it is done; a receive's data is in
    the tensor only after it."""

    __slots__ = ("_ticket",)

    def __init__(self, ticket=None):
        self._ticket = ticket

    def wait(self) -> None:
        if self._ticket is not None:
            _network().wait(_simulated.rank, self._ticket)
            self._ticket = None  # waiting twice is harmless


_DONE = Handle()  # what posting nothing returns
Waitable = Handle | dist.Work  # what irecv and isend return (or shared_gpu.StagedWork): wait()


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Waitable:
    """Post a receive from rank ``src`` into ``tensor`` (counted); returns at once.

    An empty tensor posts nothing: the sender skips its empty send too.
    """
    if tensor.numel() == 0:
        return _DONE
    src = _global(src, group)
    _record("recv", src, tensor)
    if (net := _network()) is not None:
        return Handle(ticket=net.post_recv(_simulated.rank, src, tensor))
    # torch's own handle (or the host staging's, dpcourse.shared_gpu): it has wait() too
    return _torch_p2p("irecv", tensor)(tensor, src, group)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Waitable:
    """Post a send of ``tensor`` to rank ``dst`` (counted); returns at once. Leave ``tensor``
    unchanged until the handle's ``wait()`` returns. An empty tensor sends nothing."""
    if tensor.numel() == 0:
        return _DONE
    dst = _global(dst, group)
    _record("send", dst, tensor)
    if (net := _network()) is not None:
        return Handle(ticket=net.post_send(_simulated.rank, dst, tensor))
    return _torch_p2p("isend", tensor)(tensor, dst, group)


def _torch_p2p(name: str, tensor: torch.Tensor) -> Callable:
    """torch.distributed's ``send``, ``recv``, ``isend`` or ``irecv`` for ``tensor``: over gloo, a
    GPU tensor goes through host memory (:func:`dpcourse.shared_gpu.through_host`), also in a
    process group that the runtime did not start, which has no staging installed."""
    if shared_gpu.on_gpu(tensor) and not _on_nccl():
        return shared_gpu.through_host(name)
    return getattr(dist, name)


def _on_nccl() -> bool:
    # standing in for an NCCL rank (the device audit, on gloo): the NCCL code path runs on a CPU
    machine = stand_in()
    acts_as_nccl = machine is not None and machine.rank_backend() == "nccl"
    return _network() is None and (dist.get_backend() == "nccl" or acts_as_nccl)


def posts_ahead() -> bool:
    """Whether receives may be posted long before their data is sent (see chapter 6).

    True for gloo (and MPI, and the simulated network): a posted receive waits in the
    background while this rank goes on sending and adding. False for NCCL, where every send and
    receive is a kernel queued on a CUDA stream: a receive posted early would block the stream,
    and the sends queued behind it, until its data came, which can be never. With NCCL the
    collectives move one step at a time (:func:`exchange`).
    """
    return not _on_nccl()


def exchange(
    send_tensor: torch.Tensor | None,
    dst: int,
    recv_tensor: torch.Tensor | None,
    src: int,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``send_tensor`` to ``dst`` while receiving ``recv_tensor`` from ``src``.

    The receive is posted first and both run at once, so a ring of ranks that all call this at
    once never deadlocks. With NCCL the pair is launched as one group
    (``dist.batch_isend_irecv``): two separate operations to the same peer (a ring of 2, where
    left and right are the same rank) would queue the receive in front of the send on one
    stream, on both ranks, and hang (NVIDIA/nccl issue 479). Either side may be ``None`` (or
    empty) to skip it. ``group``: ``dst`` and ``src`` are ranks of this sub-group (see above).
    """
    has_recv = recv_tensor is not None and recv_tensor.numel() > 0
    has_send = send_tensor is not None and send_tensor.numel() > 0
    if _on_nccl():
        dst, src = _global(dst, group), _global(src, group)
        ops = []
        if has_recv:
            _record("recv", src, recv_tensor)
            ops.append(dist.P2POp(dist.irecv, recv_tensor, src, group))
        if has_send:
            _record("send", dst, send_tensor)
            ops.append(dist.P2POp(dist.isend, send_tensor, dst, group))
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
        return
    handles = []
    if has_recv:
        handles.append(irecv(recv_tensor, src, group))
    if has_send:
        handles.append(isend(send_tensor, dst, group))
    for handle in handles:
        handle.wait()
