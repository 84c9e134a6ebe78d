"""``nn.DataParallel`` as PyTorch ships it, and the measurements chapter 2 makes of it.

``nn.DataParallel`` needs CUDA GPUs: without one it keeps no device list and calls the module
as it is. Each experiment here therefore runs ``nn.DataParallel`` where the machine has the GPUs
it needs, and otherwise the same four phases from :mod:`dpcourse.replicas.replication` on the
devices
:func:`~dpcourse.replicas.replication.devices_for` gives (the CPU, repeated), and says which it ran.
The clocks live here, outside the step that chapter 3 shows: :func:`timed_step` reads one after
each phase of :func:`~dpcourse.replicas.replication.data_parallel_step`.

Chapter 2: the idea of data parallelism, ``nn.DataParallel``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dpcourse import runtime
from dpcourse.one_device import models
from dpcourse.replicas import replication, scatter_gather

__all__ = [
    "InputSizeLog",
    "InputSizeRecorder",
    "SplitReport",
    "split_experiment",
    "PHASES",
    "timed_step",
    "time_phases",
    "time_parallel_apply",
    "peak_memory_per_gpu",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class InputSizeLog:
    """Where a replicated model ran and on what: one ``(device, input size, output size)`` per
    forward call. Copies of the log (``copy.deepcopy``, as
    :func:`~dpcourse.replicas.replication.device_copy` makes) are the log itself, so every replica
    of an
    :class:`InputSizeRecorder` writes to the same one."""

    calls: list[tuple[torch.device, torch.Size, torch.Size]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, device: torch.device, inp: torch.Size, out: torch.Size) -> None:
        with self._lock:  # replicas run in threads
            self.calls.append((device, inp, out))

    def clear(self) -> None:
        self.calls.clear()

    def __deepcopy__(self, memo: dict) -> InputSizeLog:
        return self


class InputSizeRecorder(nn.Module):
    """Wraps a module and logs the size of the input every copy of it sees.

    The PyTorch tutorial's experiment: wrap a model, run it under ``nn.DataParallel`` (or the
    package's replicas), and the log shows how each replica's input shrinks as devices are added.
    ``log`` is shared by all copies (see :class:`InputSizeLog`). Chapter 2.
    """

    def __init__(self, module: nn.Module, log: InputSizeLog | None = None) -> None:
        super().__init__()
        self.module = module
        self.log = InputSizeLog() if log is None else log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        self.log.record(x.device, x.shape, out.shape)
        return out


@dataclass
class SplitReport:
    """What each replica saw in :func:`split_experiment`: ``how`` it ran, on which ``devices``,
    and the input and output sizes of every replica's forward (in device order), plus the size
    of the gathered output."""

    how: str
    devices: list[torch.device]
    input_sizes: list[torch.Size]
    output_sizes: list[torch.Size]
    output_size: torch.Size

    def lines(self) -> list[str]:
        """The PyTorch tutorial's printout: one "In Model" line per replica, then "Outside"."""
        rows = [
            f"  In Model: input size {i} output size {o}"
            for i, o in zip(self.input_sizes, self.output_sizes, strict=True)
        ]
        return rows + [f"  Outside: output size {self.output_size}"]


def split_experiment(n: int, batch_size: int = 30, in_features: int = 5) -> SplitReport:
    """The "In Model: input size" experiment of PyTorch's DataParallel tutorial on ``n`` devices.

    A batch of ``batch_size`` random samples goes through an
    :class:`~dpcourse.one_device.models.MLP`
    wrapped in an :class:`InputSizeRecorder`: with ``nn.DataParallel``
    where there are at least ``n`` GPUs, else with the package's scatter, replicate,
    parallel-apply and gather on ``devices_for(n)``. Chapter 2.
    """
    devices = replication.devices_for(n)
    recorder = InputSizeRecorder(models.MLP(in_features=in_features))
    x = torch.randn(batch_size, in_features)
    gpus = runtime.gpu_count()
    with torch.no_grad():
        if gpus >= n:
            dp = nn.DataParallel(recorder.to(devices[0]), device_ids=devices)
            out = dp(x.to(devices[0]))
            how = f"nn.DataParallel on {n} GPU(s)"
        else:
            replicas = replication.create_replicas(recorder, devices)
            inputs = scatter_gather.scatter(x, devices)
            # One after another, so that the log is in replica order on repeated devices.
            outputs = scatter_gather.parallel_apply(replicas, inputs, threads=False)
            out = scatter_gather.gather(outputs, devices[0])
            names = sorted({str(d) for d in devices})
            how = (f"dpcourse.replicas.replication on {n} replica(s) on {', '.join(names)} "
                   f"(nn.DataParallel would need {n} GPU(s); this machine has {gpus})")
    calls = recorder.log.calls
    if gpus >= n:  # replicas ran in threads: put them in device order
        calls = sorted(calls, key=lambda c: c[0].index or 0)
    return SplitReport(
        how=how,
        devices=devices,
        input_sizes=[c[1] for c in calls],
        output_sizes=[c[2] for c in calls],
        output_size=out.shape,
    )


# The phases of a manual nn.DataParallel step that time_phases reports, in the order they run.
PHASES = ("replicate", "scatter", "forward", "gather", "loss+backward", "reduce", "update")


def timed_step(
    master: nn.Module,
    replicas: Sequence[nn.Module],
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    threads: bool = True,
) -> tuple[float, dict[str, float]]:
    """:func:`~dpcourse.replicas.replication.data_parallel_step`, phase by phase, with a clock read
    after each (once the devices it ran on have finished: :func:`dpcourse.runtime.synchronize`).
    Returns the loss and the seconds of each phase of ``PHASES``; the update is the same."""
    R = replication
    devices = R.replica_devices(replicas)
    master_device = R.module_device(master)
    *inputs, target = batch
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(phase: str, *where: torch.device) -> None:
        for d in set(where):
            runtime.synchronize(d)
        now = time.perf_counter()
        timings[phase] = now - clock[0]
        clock[0] = now

    R.broadcast_parameters(master, replicas)
    for r in replicas:
        r.zero_grad(set_to_none=True)
    lap("replicate", *devices)
    chunks = R.scatter(inputs, devices)
    lap("scatter", *devices)
    outputs = R.parallel_apply(replicas, chunks, threads=threads)
    lap("forward", *devices)
    output = R.gather(outputs, devices[0])
    lap("gather", devices[0])
    loss = loss_fn(output, target.to(devices[0]))
    loss.backward()
    lap("loss+backward", *devices)
    with torch.no_grad():
        for src, dst in zip(replicas[0].buffers(), master.buffers(), strict=True):
            dst.copy_(src)
    optimizer.zero_grad(set_to_none=True)
    R.reduce_gradients(replicas[: len(chunks)], master)
    lap("reduce", master_device)
    optimizer.step()
    lap("update", master_device)
    return loss.item(), timings


def time_phases(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    ns: Sequence[int],
    repeats: int = 5,
    threads: bool = False,
) -> dict[int, dict[str, float]]:
    """Seconds per phase of :func:`~dpcourse.replicas.replication.data_parallel_step` (run as
    :func:`timed_step`) for each number of replicas in ``ns`` (on ``devices_for(n)``, the master
    on the CPU, plain SGD): for each phase the shortest of ``repeats`` steps (the cost without
    interference from other work on the machine), after one untimed step. The forwards run one
    after another unless ``threads``: worker threads that each start the math library's own
    threads would make the forward's time depend on how busy the machine is. Chapter 2 plots it."""
    results = {}
    for n in ns:
        master = replication.device_copy(model, "cpu")
        replicas = replication.create_replicas(master, replication.devices_for(n))
        optimizer = torch.optim.SGD(master.parameters(), lr=1e-3)
        replication.data_parallel_step(master, replicas, batch, loss_fn, optimizer,
                                       threads=threads)
        runs = [
            timed_step(master, replicas, batch, loss_fn, optimizer, threads=threads)[1]
            for _ in range(repeats)
        ]
        results[n] = {phase: min(r[phase] for r in runs) for phase in PHASES}
    return results


def time_parallel_apply(
    model: nn.Module, ns: Sequence[int], per_replica: int = 16, repeats: int = 20
) -> dict[str, list[float]]:
    """Seconds of one :func:`~dpcourse.replicas.scatter_gather.parallel_apply` of ``n`` replicas of
    ``model`` (each on ``per_replica`` samples), for each ``n`` in ``ns``: in threads, as
    ``nn.DataParallel``
    runs them, and one after another; the shortest of ``repeats``. Chapter 2's look at the GIL."""
    results: dict[str, list[float]] = {"threads": [], "one after another": []}
    in_features = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
    for n in ns:
        devices = replication.devices_for(n)
        replicas = replication.create_replicas(model, devices)
        inputs = scatter_gather.scatter(torch.randn(per_replica * n, in_features), devices)
        for label, threads in (("threads", True), ("one after another", False)):
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                with torch.no_grad():
                    scatter_gather.parallel_apply(replicas, inputs, threads=threads)
                for d in set(devices):
                    runtime.synchronize(d)
                times.append(time.perf_counter() - start)
            results[label].append(min(times[1:]))
    return results


def peak_memory_per_gpu(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    devices: Sequence[torch.device],
    steps: int = 3,
) -> list[int]:
    """Peak bytes allocated on each GPU of ``devices`` while ``nn.DataParallel`` trains a copy
    of ``model`` with Adam for ``steps`` steps on ``batch``. Needs CUDA GPUs (chapter 2 runs it
    where there are at least two): device 0 holds the module, the gathered outputs, the summed
    gradients and the optimizer state; the others only a replica and their chunk."""
    devices = [torch.device(d) for d in devices]
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"peak_memory_per_gpu measures CUDA GPUs, got {devices}")
    module = replication.device_copy(model, devices[0])
    dp = nn.DataParallel(module, device_ids=devices)
    optimizer = torch.optim.Adam(dp.parameters())
    *inputs, target = (t.to(devices[0]) for t in batch)
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    for _ in range(steps):
        loss = loss_fn(dp(*inputs), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for d in devices:
        runtime.synchronize(d)
    return [torch.cuda.max_memory_allocated(d) for d in devices]
