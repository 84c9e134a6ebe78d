"""FSDP's communication thread: a rank's collectives in order, beside the compute (chapter 9).

FSDP's hooks submit each layer's all-gather and reduce-scatter to one thread, which runs them one
at a time in the order they were submitted. The hooks submit the same collectives in the same
order on every rank, so the ranks' rings match, and the main thread goes on computing meanwhile:
the overlap that FSDP's prefetch buys. :class:`CommThread` is that thread, the core; a
:class:`CommWork` is what ``submit`` returns, waited on like torch's ``Work``.

On a GPU a thread is not enough, and :class:`StreamedCommThread` is the layer that section 9.11
adds for it (FSDP2's design, in our words):

* the thread makes the rank's GPU its current device, which is per thread: left at ``cuda:0``,
  rank 1's collectives would run on another rank's GPU, and NCCL can hang;
* each collective's own work (the ring's copies and adds) runs on one of the thread's streams
  (:data:`STREAMS`), never on the compute stream, where it would queue behind (and ahead of) the
  matmuls. Its messages are NCCL's kernels, which ProcessGroupNCCL queues on streams of its own;
  each waits for the stream that was current when it was issued (this side stream) and
  ``work.wait()`` makes that stream wait for it, so the side stream decides what NCCL waits for;
* before it starts, its stream waits for an event recorded on the caller's stream when it was
  submitted (its inputs were computed there); :meth:`StreamedWork.wait` makes the caller's stream
  wait for an event recorded after it: the host never waits for the GPU;
* memory is freed by the streams' order, not by ``record_stream``: the tensors a collective reads
  or writes are made on the caller's stream before it is submitted, and its
  :class:`StreamedWork` holds them until :meth:`StreamedWork.wait` has made the caller's stream
  wait for the collective; freed after that, their memory can only be reused by work that the
  caller's stream runs after the collective (what torch's ProcessGroupNCCL does with
  ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``: it keeps a collective's tensors until its
  ``work.wait()``). What the collective makes on its stream (the shards' gradients) stays there
  until the next step, and that stream's next collective waits for the caller's stream first.
  ``record_stream`` frees only once the GPU has caught up with the host, so a host that runs
  ahead makes the allocator take new memory meanwhile: FSDP1's problem (its
  ``limit_all_gathers`` stopped the host instead), which FSDP2 avoids so.

:func:`comm_thread` picks the one for a device. The caller's
:func:`~dpcourse.collectives.count_traffic` sees the thread's messages.

Chapter 9: FSDP's collectives on a thread of their own, and on a GPU on streams of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dpcourse.collectives.p2p import active_counters, counted_like
from dpcourse.one_device.memory import tensors_in

__all__ = ["STREAMS", "CommWork", "CommThread", "StreamedWork", "StreamedCommThread",
           "comm_thread"]

STREAMS = ("all-gather", "reduce-scatter")  # the communication thread's streams on a GPU


class CommWork:
    """A collective submitted to a :class:`CommThread`; like torch.distributed's ``Work``,
    :meth:`wait` returns once its result may be used by the caller."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        """True once the communication thread has run (on a GPU: queued) the collective."""
        return self._future.done()

    def wait(self) -> Any:
        """The collective's result, once the thread has run it."""
        return self._future.result()

    def release(self) -> None:
        """Let the caller free the collective's tensors as early as it safely can: on the CPU
        nothing to do, since the thread let them go when the collective ended."""


class CommThread:
    """One thread that runs the collectives of a rank, one at a time, in the order they were
    submitted (:func:`comm_thread` makes the one for a device: on a GPU, the layer
    :class:`StreamedCommThread`)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpcourse-comm",
                                        initializer=self._enter)

    def _enter(self) -> None:
        """What the thread does first (on a GPU: make the rank's device its own)."""

    def submit(self, fn: Callable[..., Any], *args: Any,
               stream: str = "all-gather") -> CommWork:
        """Run ``fn(*args)`` on the thread once everything submitted before it
        has run; return at once. ``stream``: the GPU's (a CPU has none)."""
        if stream not in STREAMS:
            raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
        counters = active_counters()  # the caller's count_traffic sees them

        def run() -> Any:
            with counted_like(counters):
                return fn(*args)

        return CommWork(self._pool.submit(run))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamedWork(CommWork):
    """A collective queued on a side stream of a :class:`StreamedCommThread`. It keeps the
    tensors the collective reads and writes until :meth:`wait` (the caller frees them after)."""

    def __init__(self, work: CommWork, keep: list[torch.Tensor], device: torch.device) -> None:
        super().__init__(work._future)
        self._keep: list[torch.Tensor] | None = keep
        self.device = device

    def wait(self) -> Any:
        """The collective's result. The thread has queued it on its stream,
        and the caller's current stream now waits for it (an event), as
        ``wait()`` makes it wait for an NCCL collective: work queued on that
        stream after this call runs once the collective is done, and the
        host does not block on the GPU. Only then are the collective's
        tensors let go: their memory, freed, goes back to the caller's
        stream, which now runs after it."""
        result, done = self._future.result()
        torch.cuda.current_stream(self.device).wait_event(done)
        self._keep = None
        return result

    def release(self) -> None:
        """:meth:`wait` (the host waits only for the thread to have queued the collective), so
        that the caller may free the collective's tensors."""
        if self._keep is not None:
            self.wait()


class StreamedCommThread(CommThread):
    """The communication thread on a GPU: it works on ``device`` and queues each collective on
    a stream of its own (:data:`STREAMS`), ordered with the caller's stream by CUDA events."""

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.streams = {kind: torch.cuda.Stream(device) for kind in STREAMS}
        super().__init__(device)

    def _enter(self) -> None:
        torch.cuda.set_device(self.device)  # the current device is per thread; it starts on 0

    def submit(self, fn: Callable[..., Any], *args: Any,
               stream: str = "all-gather") -> StreamedWork:
        """Run ``fn(*args)`` on the thread, on the stream named ``stream``,
        once the caller's stream has made its inputs. Make the tensors
        ``fn`` writes into on the caller's stream; pass them in ``args``."""
        side = self.streams.get(stream)
        caller = torch.cuda.current_stream(self.device)
        ready = caller.record_event()  # the inputs: queued before this

        def on_side_stream() -> tuple[Any, torch.cuda.Event]:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                result = fn(*args)
                return result, side.record_event()

        work = super().submit(on_side_stream, stream=stream)
        return StreamedWork(work, tensors_in(args), self.device)


def comm_thread(device: torch.device | str | None = None) -> CommThread:
    """The communication thread for tensors on ``device``: on a GPU, with its streams."""
    device = torch.device(device if device is not None else "cpu")
    return StreamedCommThread(device) if device.type == "cuda" else CommThread(device)
