"""The message layer every collective of the course is built on: point-to-point sends.

Chapters 5 and 6 build broadcast, reduce and all-reduce out of nothing but ``send`` and
``recv`` between pairs of ranks. Everything they send goes through this module, which

* **counts** the bytes and messages each rank sends and receives (:func:`count_traffic`), so the
  chapters can check the formulas: the ring sends 2(N-1)/N of the data per rank, whatever N;
* **posts receives before sends** (:func:`exchange`): gloo moves data only once the receiver has
  posted its receive, so "everyone sends, then everyone receives" would deadlock on a ring;
* **stages CUDA tensors through the CPU** when the backend is gloo, whose send and recv take CPU
  tensors only; with NCCL, tensors go GPU to GPU;
* can be pointed at a **simulated network** instead of torch.distributed
  (:mod:`dpcourse.simulate`), so that the same collective code runs on thousands of virtual
  ranks with links of a chosen latency and bandwidth.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Traffic", "count_traffic", "send", "recv", "exchange", "exchange_pieces",
           "rank_and_size"]


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
# Set per thread by dpcourse.simulate: that thread is a virtual rank of a simulated network.
_simulated = threading.local()


def _network():
    return getattr(_simulated, "network", None)


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count this rank's point-to-point traffic inside the ``with`` block."""
    traffic = Traffic()
    if not hasattr(_counting, "active"):
        _counting.active = []
    _counting.active.append(traffic)
    try:
        yield traffic
    finally:
        _counting.active.remove(traffic)


def _record(kind: str, peer: int, tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    for t in getattr(_counting, "active", ()):
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
            "started with dpcourse.launch.run_ranks(fn, world_size), or in a script started by "
            "torchrun after dpcourse.runtime.init_process_group()."
        )
    return dist.get_rank(), dist.get_world_size()


def _needs_staging(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" and dist.get_backend() == "gloo"


def send(tensor: torch.Tensor, dst: int) -> None:
    """Blocking send of ``tensor`` to rank ``dst`` (counted)."""
    _record("send", dst, tensor)
    if (net := _network()) is not None:
        net.wait(_simulated.rank, net.post_send(_simulated.rank, dst, tensor))
        return
    dist.send(tensor.cpu() if _needs_staging(tensor) else tensor, dst)


def recv(tensor: torch.Tensor, src: int) -> None:
    """Blocking receive from rank ``src`` into ``tensor`` (counted)."""
    _record("recv", src, tensor)
    if (net := _network()) is not None:
        net.wait(_simulated.rank, net.post_recv(_simulated.rank, src, tensor))
        return
    if _needs_staging(tensor):
        buf = torch.empty_like(tensor, device="cpu")
        dist.recv(buf, src)
        tensor.copy_(buf)
    else:
        dist.recv(tensor, src)


def exchange(
    send_tensor: torch.Tensor | None, dst: int, recv_tensor: torch.Tensor | None, src: int
) -> None:
    """Send ``send_tensor`` to ``dst`` while receiving ``recv_tensor`` from ``src``.

    The receive is posted first and both run asynchronously, so a ring of ranks that all call
    this at once never deadlocks. Either side may be ``None`` (or empty) to skip it.
    """
    if (net := _network()) is not None:
        me, tickets = _simulated.rank, []
        if recv_tensor is not None and recv_tensor.numel() > 0:
            _record("recv", src, recv_tensor)
            tickets.append(net.post_recv(me, src, recv_tensor))
        if send_tensor is not None and send_tensor.numel() > 0:
            _record("send", dst, send_tensor)
            tickets.append(net.post_send(me, dst, send_tensor))
        for ticket in tickets:
            net.wait(me, ticket)
        return
    works = []
    staged = None
    if recv_tensor is not None and recv_tensor.numel() > 0:
        _record("recv", src, recv_tensor)
        staged = (
            torch.empty_like(recv_tensor, device="cpu") if _needs_staging(recv_tensor) else None
        )
        works.append(dist.irecv(staged if staged is not None else recv_tensor, src))
    if send_tensor is not None and send_tensor.numel() > 0:
        _record("send", dst, send_tensor)
        out = send_tensor.cpu() if _needs_staging(send_tensor) else send_tensor
        works.append(dist.isend(out, dst))
    for w in works:
        w.wait()
    if staged is not None:
        recv_tensor.copy_(staged)


def exchange_pieces(
    send_tensor: torch.Tensor, dst: int, recv_tensor: torch.Tensor, src: int, piece: int
) -> Iterator[slice]:
    """Like :func:`exchange` for 1-d tensors, cut into pieces of ``piece`` elements, yielding
    the slice of each received piece as soon as it has arrived.

    All receives and sends are posted at once, so the caller can work on piece k (add it to
    its own data) while pieces k+1, ... are still on the wire: the pipelining that makes large
    reduce-scatters faster. Under the simulated network the pieces arrive in order.
    """
    n_recv, n_send = recv_tensor.numel(), send_tensor.numel()
    recv_slices = [slice(i, min(i + piece, n_recv)) for i in range(0, n_recv, piece)]
    send_slices = [slice(i, min(i + piece, n_send)) for i in range(0, n_send, piece)]
    if _network() is not None or _needs_staging(recv_tensor) or _needs_staging(send_tensor):
        for r, s_ in zip(recv_slices, send_slices, strict=False):  # one piece at a time
            exchange(send_tensor[s_], dst, recv_tensor[r], src)
            yield r
        for r in recv_slices[len(send_slices):]:
            exchange(None, dst, recv_tensor[r], src)
            yield r
        for s_ in send_slices[len(recv_slices):]:
            exchange(send_tensor[s_], dst, None, src)
        return
    receives = []
    for r in recv_slices:
        _record("recv", src, recv_tensor[r])
        receives.append(dist.irecv(recv_tensor[r], src))
    sends = []
    for s_ in send_slices:
        _record("send", dst, send_tensor[s_])
        sends.append(dist.isend(send_tensor[s_], dst))
    for r, work in zip(recv_slices, receives, strict=True):
        work.wait()
        yield r
    for work in sends:
        work.wait()
