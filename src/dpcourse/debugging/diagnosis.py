"""Appendix: the diagnosis lab. Faults injected on ranks, and the measurements that find them.

Each ``reproduce_*`` function runs a small job on several ranks with one fault injected and
returns what an engineer would look at: per-rank times, the stacks of a hung run, step times
beside all-reduce times, a bandwidth figure. The faults:

1. a straggler: one rank sleeps before each all-reduce (:func:`reproduce_straggler`);
2. a skipped collective: one rank ``continue``s past the all-reduce of one step, as code that
   skips a non-finite loss would, and the others wait for it forever (:func:`reproduce_hang`);
3. buckets that are too small: DDP with ``bucket_cap_mb=0`` against one process on the same
   global batch (:func:`reproduce_small_buckets`);
4. a misread bandwidth: a measured all-reduce printed as a colleague's scripts print it,
   with the wrong quantity or the wrong unit (:func:`measure_all_reduce`,
   :func:`colleague_reports`), and the busbw a link allows (:func:`busbw_ceiling`).

The tools that name such faults on NCCL as well (DETAIL checks, the flight recorder) are in
:mod:`dpcourse.debugging.diagnosis_tools`.

The lab's scenario (which rank, how long, which step) lives in the constants below, so that the
notebook's cells do not give the answer away; the exercises name the cause with the keys of
:data:`CAUSES`.

Appendix: the diagnosis lab (diagnosing slow or hung training).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpcourse.collectives.commbench import bus_bandwidth
from dpcourse.one_device.models import MLP
from dpcourse.timing import DeviceClock

__all__ = [
    "CAUSES", "LAB_WORLD_SIZE", "STRAGGLER_RANK", "STRAGGLER_DELAY_S", "SKIPPING_RANK",
    "SKIPPED_STEP", "HANG_TIMEOUT_S", "BANDWIDTH_WORLD_SIZE", "training_steps_on_rank",
    "RankTimes", "HangReport", "BucketRun", "AllReduceTiming", "busbw_ceiling",
    "colleague_reports",
]  # fmt: skip

# The causes an exercise's answer is chosen from: the key, and what it means.
CAUSES: dict[str, str] = {
    "straggler": "one rank takes longer before the all-reduce; the others wait for it inside it",
    "slow network": "the all-reduce itself is slow on every rank: the link moves bytes slowly",
    "skipped collective": "one rank did not call a collective that the others called",
    "timeout too short": "the run was healthy, only slower than the timeout allowed",
    "small buckets": "the gradient goes out in many small all-reduces, each paying the latency",
    "shared cores": "the ranks compete for the same CPU cores (more ranks than cores)",
    "busbw as algbw": "the number is the bus bandwidth, algbw x 2(N-1)/N, labelled algbw",
    "GiB as GB": "the bytes were divided by 2**30 (GiB) but the unit printed is GB (10**9)",
    "bits as bytes": "bits per second read as bytes per second (or the reverse): a factor of 8",
    "warm-up timed": "the first, slow call (connections, buffers) is inside the timing",
}

# The lab's scenario.
LAB_WORLD_SIZE = 3
STRAGGLER_RANK, STRAGGLER_DELAY_S = 2, 0.04
SKIPPING_RANK, SKIPPED_STEP = 1, 2
HANG_TIMEOUT_S = 3.0
BANDWIDTH_WORLD_SIZE = 4


# ------------------------------------------------------------------- 1-2: a training loop
def training_steps_on_rank(
    steps: int = 12,
    warmup: int = 2,
    *,
    slow_rank: int | None = None,
    delay_s: float = 0.0,
    skip_rank: int | None = None,
    skip_step: int = -1,
    width: int = 256,
    batch: int = 64,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> dict[str, list[float]]:
    """Runs on every rank: ``steps`` SGD steps of a small MLP whose gradient is averaged by one
    all-reduce of the flat gradient per step (over ``group``, the default group if None).
    Returns per-step seconds (after ``warmup``): ``compute`` (forward and backward), ``wait``
    (inside the all-reduce) and ``step``.

    The clock is a :class:`dpcourse.timing.DeviceClock` on ``device``: the host's clock on the
    CPU, where a gloo all-reduce returns when it is done; CUDA events on a GPU, where an NCCL
    all-reduce returns once it is queued and the host's clock would time only the queuing (the
    lab's section 5). The stamps are read after the last step, as a GPU's events must be.

    Faults: rank ``slow_rank`` sleeps ``delay_s`` after backward (a straggler); rank
    ``skip_rank`` skips the all-reduce and the update of step ``skip_step``."""

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP(width, width, width).to(device)
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(batch, width, generator=g).to(device) for _ in range(2))
    clock, stamps = DeviceClock(device), []
    for step in range(steps):
        t0 = clock.stamp()
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if rank == slow_rank:
            time.sleep(delay_s)
        if rank == skip_rank and step == skip_step:
            continue  # "the loss was not finite on this rank: skip the update"
        t1 = clock.stamp()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat, group=group)
        t2 = clock.stamp()
        with torch.no_grad():  # SGD on the averaged gradient (torch.optim's first use is slow)
            flat /= dist.get_world_size(group)
            torch.nn.utils.vector_to_parameters(
                torch.nn.utils.parameters_to_vector(model.parameters()) - 1e-3 * flat,
                model.parameters(),
            )
        if step >= warmup:
            stamps.append((t0, t1, t2, clock.stamp()))
    print(f"finished {steps} steps")
    return {
        "compute": [clock.elapsed(t0, t1) for t0, t1, _, _ in stamps],
        "wait": [clock.elapsed(t1, t2) for _, t1, t2, _ in stamps],
        "step": [clock.elapsed(t0, end) for t0, _, _, end in stamps],
    }


@dataclass
class RankTimes:
    """Median seconds per step of each rank, in rank order: before the all-reduce
    (``compute``), inside it (``wait``) and in all (``step``)."""

    compute: list[float]
    wait: list[float]
    step: list[float]

    def table(self) -> str:
        lines = [f"{'rank':>4} {'compute':>10} {'all-reduce':>11} {'step':>9}"]
        for r, (c, w, s) in enumerate(zip(self.compute, self.wait, self.step, strict=True)):
            lines.append(f"{r:>4} {c * 1e3:>8.1f}ms {w * 1e3:>9.1f}ms {s * 1e3:>7.1f}ms")
        return "\n".join(lines)


@dataclass
class HangReport:
    """A run that the launcher's timeout ended: which ranks were still running (``stalled``),
    which had returned (``finished``), each stalled rank's stack, and the error's text."""

    stalled: list[int]
    finished: list[int]
    stacks: dict[int, str]
    message: str
    seconds: float


# ---------------------------------------------------------------- 3: buckets too small
@dataclass
class BucketRun:
    """Median step seconds of one process on the global batch (``one_process``) and of each
    DDP variant on ``world_size`` ranks (``ddp``, by ``bench.ddp`` label); all-reduces per step
    of each variant; the gradient's bytes; the seconds of one all-reduce of 4 bytes
    (``tiny_all_reduce``) and of the whole gradient at once (``gradient_all_reduce``), each the
    10th percentile of 20: the time without the stalls that a busy machine adds now and then."""

    world_size: int
    global_batch: int
    one_process: float
    ddp: dict[str, float]
    all_reduces: dict[str, int]
    grad_bytes: int
    tiny_all_reduce: float
    gradient_all_reduce: float

    def evidence(self) -> str:
        """What the colleague's run shows (its DDP is the ``"DDP cap 0"`` variant)."""
        ms, n = 1e3, self.world_size
        return "\n".join([
            f"one process, batch {self.global_batch}: {self.one_process * ms:.1f} ms per step",
            f"colleague's DDP, {n} ranks x {self.global_batch // n}: "
            f"{self.ddp['DDP cap 0'] * ms:.1f} ms per step",
            f"all-reduces per step in the colleague's DDP: {self.all_reduces['DDP cap 0']}",
            f"one all-reduce of 4 bytes, alone: {self.tiny_all_reduce * ms:.2f} ms",
            f"one all-reduce of the whole gradient ({self.grad_bytes / 1e6:.2f} MB), alone: "
            f"{self.gradient_all_reduce * ms:.2f} ms",
        ])  # fmt: skip


# ------------------------------------------------------------------- 4: bandwidth figures
@dataclass
class AllReduceTiming:
    """One all-reduce of ``nbytes`` on ``world_size`` ranks took ``seconds`` (median)."""

    nbytes: int
    world_size: int
    seconds: float

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, bytes per second: the payload over the time."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bus bandwidth (nccl-tests): ``algbw * 2(N-1)/N``, bytes per second."""

        return bus_bandwidth(self.nbytes, self.seconds, self.world_size)

    def line(self) -> str:
        """The figures, labelled correctly."""
        return (
            f"all_reduce of {self.nbytes / 1e6:.2f} MB ({self.nbytes / 2**20:g} MiB) on "
            f"{self.world_size} ranks in {self.seconds * 1e3:.2f} ms: algbw "
            f"{self.algbw / 1e9:.3f} GB/s = {self.algbw / 2**30:.3f} GiB/s, busbw "
            f"{self.busbw / 1e9:.3f} GB/s"
        )


def busbw_ceiling(link_rate: float, world_size: int, in_network: bool = False) -> float:
    """The largest busbw (bytes per second) an all-reduce can report where each rank's link
    carries ``link_rate`` each way. A ring or tree, where the ranks do the sums, sends at least
    ``2(N-1)/N`` of the data through every rank's link, so its busbw cannot exceed the link's
    rate. Where switches do the sums (``in_network``: NVLS in NVSwitch, SHARP in InfiniBand), a
    rank sends its data once and receives the sum once, so the time can fall to
    ``S / link_rate`` and busbw, still counted with the ring's factor, can reach
    ``link_rate * 2(N-1)/N``. The lab's section 4 compares both with a reported figure."""
    factor = 2 * (world_size - 1) / world_size
    return link_rate * factor if in_network else link_rate


def colleague_reports(t: AllReduceTiming) -> dict[str, str]:
    """Fault 4: the same measurement as two colleagues' scripts print it, each with one
    mistake: report A prints the bus bandwidth as algbw, report B prints GiB/s as GB/s."""
    head = f"all_reduce {t.nbytes / 1e6:.2f} MB, {t.world_size} ranks, {t.seconds * 1e3:.2f} ms"
    return {
        "A": f"{head}: algbw {t.busbw / 1e9:.3f} GB/s",
        "B": f"{head}: algbw {t.algbw / 2**30:.3f} GB/s",
    }
