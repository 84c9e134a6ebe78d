"""When each bucket's all-reduce ran in one step of the from-scratch DDP: chapter 7's timeline.

:func:`timed_backward` runs one ``loss.backward()`` of a :class:`dpcourse.ddp.ddp.DDP` and
records, on a :class:`dpcourse.timing.DeviceClock`, when backward ended and when each bucket's
all-reduce was launched and completed (:class:`StepTimeline`); chapter 7 draws it with
:func:`dpcourse.plots.ddp.plot_timeline`. The timing code lives here, not in the DDP that
chapter 7 shows: the recorder wraps the reducer's :meth:`~dpcourse.ddp.buckets.BucketManager.launch`
and DDP's :meth:`~dpcourse.ddp.ddp.DDP.finish_at_end_of_backward` for one step.
:func:`bucket_events` records, the same way, the reducer's own events in one backward (each
gradient entering its bucket, each bucket's launch and completion), from which chapter 7 draws
its animation of buckets filling and leaving (:func:`dpcourse.plots.ddp.bucket_animation`).

Chapter 7: DDP's bucket timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dpcourse.timing import DeviceClock

__all__ = ["BucketEvent", "BucketTiming", "StepTimeline", "bucket_events", "timelines_from_json",
           "timed_backward"]


@dataclass
class BucketTiming:
    """One bucket in one step: seconds since backward started (see :func:`timed_backward`)."""

    index: int
    nbytes: int
    launched_s: float
    completed_s: float



@dataclass
class StepTimeline:
    """When backward ended and each bucket's all-reduce was launched and completed; chapter 7
    plots it with :func:`dpcourse.plots.ddp.plot_timeline`."""

    backward_s: float
    finished_s: float
    buckets: list[BucketTiming]



def timelines_from_json(timelines: dict) -> dict[str, StepTimeline]:
    """Timelines as a recorded JSON holds them (``dataclasses.asdict``), back as
    :class:`StepTimeline` objects (chapter 7 draws a recorded run where it cannot measure)."""
    return {name: StepTimeline(t["backward_s"], t["finished_s"],
                               [BucketTiming(**b) for b in t["buckets"]])
            for name, t in timelines.items()}



def timed_backward(ddp_model, loss) -> StepTimeline:
    """``loss.backward()`` for a :class:`dpcourse.ddp.ddp.DDP` (whose end synchronises the
    gradients), recording when each bucket's all-reduce was launched and completed, relative
    to the start of backward; ``backward_s`` is when the gradients were all computed (the
    engine's end-of-backward callback started), ``finished_s`` when they were all averaged.

    The recorder wraps the reducer's ``launch`` and DDP's end-of-backward callback for the
    duration of the step (neither has timing code), and reads a
    :class:`dpcourse.timing.DeviceClock` on the loss's device. On the CPU that is the host's
    clock, and completion is when gloo reported it (a callback on the all-reduce's future).
    On a GPU every time is a CUDA event: "launched" is recorded on the compute stream right
    after the launch, so it is when the GPU had computed the bucket's gradients and the
    all-reduce could start; "completed" is recorded in the future's callback, on a stream that
    waits for the all-reduce, so it is when the GPU had finished it (the host's clock would
    show only when each was queued).
    """

    reducer = ddp_model.reducer
    launch_untimed = reducer.launch
    clock = DeviceClock(loss.device)
    launches: list = []  # (index, nbytes, stamp)
    completions: dict = {}  # index -> stamp, from the futures' callbacks

    def launch_timed(bucket) -> None:
        launch_untimed(bucket)
        launches.append((bucket.index, bucket.nbytes, clock.stamp()))

        def done(fut, index=bucket.index):
            completions[index] = clock.stamp()

        bucket.work.get_future().then(done)

    finish_untimed = ddp_model.finish_at_end_of_backward
    computed: list = []

    def finish_timed() -> None:
        computed.append(clock.stamp())
        finish_untimed()

    reducer.launch = launch_timed  # instance attributes: this model, this step only
    ddp_model.finish_at_end_of_backward = finish_timed
    try:
        loss.backward()
        ddp_model.finish_gradient_synchronization()  # already done: returns at once
        finished = clock.stamp()
    finally:
        del reducer.launch, ddp_model.finish_at_end_of_backward
    deadline = time.perf_counter() + 1.0
    while len(completions) < len(launches) and time.perf_counter() < deadline:
        time.sleep(1e-4)  # the callbacks may run a moment after wait() returns
    finished_s = clock.seconds(finished)
    backward_s = clock.seconds(computed[0]) if computed else finished_s
    timings = [
        BucketTiming(index, nbytes, clock.seconds(stamp),
                     clock.seconds(completions[index]) if index in completions else -1.0)
        for index, nbytes, stamp in launches
    ]
    return StepTimeline(backward_s, finished_s, sorted(timings, key=lambda t: t.index))



@dataclass
class BucketEvent:
    """One event of the reducer in one backward: ``"ready"`` (the gradient of the parameter in
    slot ``slot`` of bucket ``bucket`` entered it), ``"launched"`` or ``"completed"`` (the bucket's
    all-reduce; ``slot`` is -1), ``seconds`` after backward started."""

    kind: str
    bucket: int
    slot: int
    seconds: float


def bucket_events(ddp_model, loss) -> tuple[list[BucketEvent], list[list[int]]]:
    """``loss.backward()`` and the synchronisation of a :class:`dpcourse.ddp.ddp.DDP`, recording
    the reducer's own events in the order they happened (see :class:`BucketEvent`); and each
    bucket's slots, their sizes in bytes. As :func:`timed_backward` does, the recorder wraps the
    reducer's ``mark_ready`` and ``launch`` for this step only (host clock; on a GPU the order is
    the order in which the host saw them)."""
    reducer = ddp_model.reducer
    mark_untracked, launch_untracked = reducer.mark_ready, reducer.launch
    start = time.perf_counter()
    events: list[BucketEvent] = []

    def seconds() -> float:
        return time.perf_counter() - start

    def mark_ready_tracked(param, launch: bool) -> None:
        bucket, k = reducer.where[param]
        events.append(BucketEvent("ready", bucket.index, k, seconds()))
        mark_untracked(param, launch)

    def launch_tracked(bucket) -> None:
        launch_untracked(bucket)
        events.append(BucketEvent("launched", bucket.index, -1, seconds()))

        def done(fut, index=bucket.index):
            events.append(BucketEvent("completed", index, -1, seconds()))

        bucket.work.get_future().then(done)

    reducer.mark_ready, reducer.launch = mark_ready_tracked, launch_tracked
    try:
        loss.backward()
        ddp_model.finish_gradient_synchronization()
    finally:
        del reducer.mark_ready, reducer.launch
    deadline = time.perf_counter() + 1.0
    launched = sum(e.kind == "launched" for e in events)
    while sum(e.kind == "completed" for e in events) < launched and time.perf_counter() < deadline:
        time.sleep(1e-4)  # the callbacks may run a moment after wait() returns
    slots = [[p.numel() * p.element_size() for p in b.params] for b in reducer.buckets]
    return sorted(events, key=lambda e: e.seconds), slots
