"""Measured DDP steps for chapter 10: the points the step-time model is checked against.

:func:`ddp_step_times_on_rank` times ``torch.nn.parallel.DistributedDataParallel`` steps of the
course's MLP, the same steps without communication, and all-reduces of a few sizes (to fit alpha
and beta as in chapter 6), on whatever ranks it runs on. A measurement rig, not a lesson: the
model it is compared with is :mod:`dpcourse.cost.scaling`. (Not a ``python -m
dpcourse.harness.bench`` command: chapter 10 runs it with
:func:`dpcourse.harness.launch.run_ranks`.)

Chapter 10: measured DDP step times on this machine.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpcourse import runtime
from dpcourse.collectives.commbench import slowest_rank, time_all_reduce_on_rank
from dpcourse.one_device.models import MLP

__all__ = ["ddp_step_times_on_rank"]


def ddp_step_times_on_rank(
    per_rank_batches: Sequence[int],
    hidden: int = 512,
    in_features: int = 64,
    steps: int = 15,
    warmup: int = 3,
    comm_sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22),
    comm_repeats: int = 5,
    bucket_cap_mb: float = 25.0,
) -> dict:
    """Run on every rank (with :func:`dpcourse.harness.launch.run_ranks`, any N including 1): for
    each per-rank batch size, median seconds of a ``torch`` DDP training step of the course's MLP
    and of the same step without DDP (the compute alone), interleaved, each step started after a
    barrier and counted on the slowest rank; plus median all-reduce times of ``comm_sizes``
    bytes (``dist.all_reduce``, float32) to fit alpha and beta as in chapter 6.

    The model is ``MLP(in_features, hidden, 2)`` on the rank's device
    (:func:`dpcourse.runtime.device`): CPU with gloo here, a GPU with NCCL where there is one.
    Returns ``{"world_size", "device", "num_params", "grad_bytes", "batches", "compute",
    "ddp", "comm_sizes", "comm"}`` (times in seconds, the same on every rank; ``device`` is the
    rank's own). Chapter 10 compares them with :func:`dpcourse.cost.scaling.step_time`, fitted to
    this machine.
    """
    device = runtime.device()
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = MLP(in_features, hidden, 2).to(device)
    num_params = sum(p.numel() for p in base.parameters())
    plain = copy.deepcopy(base)
    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, device_ids=None)
    opts = {
        "compute": torch.optim.SGD(plain.parameters(), lr=1e-3),
        "ddp": torch.optim.SGD(ddp.parameters(), lr=1e-3),
    }
    models = {"compute": plain, "ddp": ddp}
    loss_fn = nn.MSELoss()
    out: dict[str, list[float]] = {"compute": [], "ddp": []}
    for b in per_rank_batches:
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        x = torch.randn(b, in_features, generator=g).to(device)
        y = torch.randn(b, 2, generator=g).to(device)
        times: dict[str, list[float]] = {"compute": [], "ddp": []}
        for i in range(warmup + steps):
            for name, model in models.items():  # interleaved: drifts in load hit both alike
                dist.barrier()
                runtime.synchronize(device)
                start = time.perf_counter()
                opts[name].zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opts[name].step()
                runtime.synchronize(device)
                elapsed = slowest_rank(time.perf_counter() - start, device)
                if i >= warmup:
                    times[name].append(elapsed)
        for name in out:
            out[name].append(statistics.median(times[name]))
    comm = [0.0] * len(comm_sizes)
    if world > 1:
        comm = time_all_reduce_on_rank(comm_sizes, ("library",), comm_repeats)["library"]
    return {
        "world_size": world,
        "device": str(device),
        "num_params": num_params,
        "grad_bytes": 4 * num_params,
        "batches": list(per_rank_batches),
        "compute": out["compute"],
        "ddp": out["ddp"],
        "comm_sizes": list(comm_sizes),
        "comm": comm,
    }
