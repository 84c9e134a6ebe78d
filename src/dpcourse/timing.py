"""Timing work that a device runs asynchronously: the host's clock on the CPU, CUDA events on a GPU.

On the CPU (and with gloo) a call returns when its work is done, so ``time.perf_counter()``
read after it times the work. On a GPU, a kernel or an NCCL collective returns as soon as it is
*queued* on a CUDA stream: the host's clock read after it times the queuing, often microseconds
for milliseconds of work. :class:`DeviceClock` hides the difference. On a GPU, each
:meth:`~DeviceClock.stamp` records a CUDA event (``torch.cuda.Event(enable_timing=True)``) on
the current stream, which the GPU timestamps when it reaches it, that is once everything queued
before it on that stream has run; an event recorded after ``work.wait()`` (which makes the
current stream wait for the collective) is therefore when the collective had finished. The
events are read after they have completed, as seconds since a start event that the clock
recorded on an idle GPU, at the same moment as it read the host's clock: host and device times
share one zero. On the CPU a stamp is ``time.perf_counter()``, as before.

Used by the exercise ex-5-overlap and by :func:`dpcourse.ddp.timeline.timed_backward`, chapter
7's timeline of the buckets' all-reduces.

Chapter 5: timing asynchronous work on the CPU and on GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dpcourse import runtime

__all__ = ["Stamp", "DeviceClock"]


@dataclass(frozen=True)
class Stamp:
    """A moment on a :class:`DeviceClock`: the host's seconds since the clock started, or a
    CUDA event that the GPU timestamps when its stream reaches it."""

    host_s: float | None = None
    event: torch.cuda.Event | None = None


class DeviceClock:
    """Seconds since the clock was made, measured where ``device``'s work runs.

    Making one waits for ``device`` (``runtime.synchronize``), so the start is not blurred by
    work queued earlier. :meth:`stamp` marks "now" in the order of the current stream;
    :meth:`seconds` reads a stamp, waiting for its event if it has not happened yet. Read the
    stamps after the work, not between its steps: reading one waits for the GPU. Chapter 5.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else runtime.device()
        self.uses_events = self.device.type == "cuda"
        runtime.synchronize(self.device)  # nothing queued: the start event runs at once
        self._start: torch.cuda.Event | None = None
        if self.uses_events:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))
        self._t0 = time.perf_counter()

    def host(self) -> float:
        """The host's seconds since the start (when the CPU gets here, on any device)."""
        return time.perf_counter() - self._t0

    def stamp(self) -> Stamp:
        """Now, as the device sees it: on a GPU an event recorded on the current stream (it
        happens when the work queued before it on that stream is done), else the host's time.

        Inside a callback of a collective's future (``work.get_future().then(...)``) the
        current stream is one that waits for the collective, so a stamp there is when the
        collective finished on the GPU."""
        if not self.uses_events:
            return Stamp(host_s=self.host())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return Stamp(event=event)

    def seconds(self, stamp: Stamp) -> float:
        """Seconds from the start to ``stamp`` (waits for a CUDA event still in the queue)."""
        if stamp.event is None:
            assert stamp.host_s is not None
            return stamp.host_s
        stamp.event.synchronize()
        return self._start.elapsed_time(stamp.event) / 1e3  # elapsed_time is in milliseconds

    def elapsed(self, start: Stamp, end: Stamp) -> float:
        """Seconds from ``start`` to ``end``."""
        return self.seconds(end) - self.seconds(start)
