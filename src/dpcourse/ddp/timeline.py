"""When each bucket's all-reduce ran in one step of the from-scratch DDP: chapter 7's timeline.

:func:`timed_backward` runs one ``loss.backward()`` of a :class:`dpcourse.ddp.ddp.DDP` and
records, on a :class:`dpcourse.timing.DeviceClock`, when backward ended and when each bucket's
all-reduce was launched and completed (:class:`StepTimeline`); chapter 7 draws it with
:func:`dpcourse.plots.ddp.plot_timeline`. The timing code lives here, not in the DDP that
chapter 7 shows: the recorder wraps the reducer's :meth:`~dpcourse.ddp.buckets.BucketManager.launch`
and DDP's :meth:`~dpcourse.ddp.ddp.DDP.finish_at_end_of_backward` for one step.

Chapter 7: DDP's bucket timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dpcourse.timing import DeviceClock

__all__ = ["BucketTiming", "StepTimeline", "timelines_from_json", "timed_backward"]


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

