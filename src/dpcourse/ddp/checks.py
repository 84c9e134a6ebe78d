"""What DDP checks before it wraps a module, so that a mistake is an error, not a hang.

A process group must exist; the module must live on one device; every rank must wrap the same
model (or the broadcasts and all-reduces would pair up different tensors); and torch's
``DistributedDataParallel`` arguments that :class:`dpcourse.ddp.ddp.DDP` accepts must mean what they
can mean here (:func:`check_torch_options`).

Chapter 7: the checks of DistributedDataParallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_process_group", "check_module", "check_same_model_on_every_rank",
           "check_torch_options", "check_bucket_cap"]

# torch's DistributedDataParallel arguments that have no meaning for the course's DDP
_TORCH_ONLY = {
    "mixed_precision": "cast the model or use torch.autocast (chapter 8)",
    "device_mesh": "one process group is all the course's DDP uses",
    "delay_all_reduce_named_params": "every parameter is reduced in its bucket",
    "param_to_hook_all_reduce": "every parameter is reduced in its bucket",
    "skip_all_reduce_unused_params": "unused parameters are reduced as zeros",
}


def check_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs a process group, and none is initialised in this process. Run the "
            "code on ranks with dpcourse.harness.launch.run_ranks(fn, world_size), or under "
            "torchrun "
            "after dpcourse.runtime.init_process_group()."
        )


def check_module(module: nn.Module, who: str) -> torch.device:
    """The one device all of ``module``'s parameters and buffers are on."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} wraps an nn.Module, got {type(module).__name__}")
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    devices = {}
    for name, t in tensors.items():
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ValueError(
            f"{who} needs every parameter and buffer of the module on one device, found {where}. "
            "Move the module with module.to(dpcourse.runtime.device()) before wrapping it."
        )
    return next(iter(devices), torch.device("cpu"))


def check_same_model_on_every_rank(module: nn.Module, device: torch.device) -> None:
    """All ranks must hold the same parameters and buffers (shapes, and which parameters are
    trainable), or the broadcasts and all-reduces would pair up different tensors and fail or
    hang. One all-reduce of a few numbers (their maximum and minimum over the ranks) finds a
    difference."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    layout = tuple((tuple(p.shape), p.requires_grad) for p in params)
    layout += tuple(tuple(b.shape) for b in module.buffers())
    fingerprint = float(hash(layout) % (2**52))  # hashes of ints and tuples are not salted
    stats = torch.tensor(
        [len(trainable), sum(p.numel() for p in trainable), fingerprint], dtype=torch.float64
    )
    both = torch.cat([stats, -stats]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[:3].cpu(), -both[3:].cpu()
    if not torch.equal(high, low):
        raise RuntimeError(
            f"the ranks wrap different models: rank {dist.get_rank()} has {len(trainable)} "
            f"parameters that need gradients ({int(stats[1])} values); across the ranks the "
            f"counts range from {int(low[0])} to {int(high[0])} parameters and {int(low[1])} "
            f"to {int(high[1])} values, or the shapes of parameters or buffers differ. Build the "
            "same model, with the same frozen parameters, on every rank."
        )


def check_torch_options(device: torch.device, device_ids, output_device, dim: int,
                        process_group, unsupported: dict) -> None:
    """torch's ``DistributedDataParallel`` arguments as the course's DDP can honour them: the
    device arguments must name the module's device, ``dim`` must be 0, ``process_group`` the
    default group; an argument it does not know is refused by name."""
    for name in unsupported:
        why = _TORCH_ONLY.get(name)
        raise TypeError(f"DDP() does not take {name}=" + (f" ({why})" if why else
                        ": it is not an argument of torch's DistributedDataParallel either"))

    def same(d) -> bool:
        if d is None:
            return True
        d = torch.device(d) if not isinstance(d, int) else torch.device(device.type, d)
        return d.type == device.type and (d.index is None or d.index == (device.index or 0))

    if device_ids is not None and (len(device_ids) != 1 or not same(device_ids[0])):
        raise ValueError(f"device_ids={device_ids!r}: DDP drives one device per process, the "
                         f"module's ({device}); pass [that device] or None")
    if not same(output_device):
        raise ValueError(f"output_device={output_device!r}: the outputs stay on the module's "
                         f"device, {device}")
    if dim != 0:
        raise ValueError(f"dim={dim}: each rank runs its own batch; only dim=0 means anything")
    if process_group not in (None, dist.group.WORLD):
        raise ValueError("process_group: the course's DDP runs on the default process group; "
                         "pass None")


def check_bucket_cap(bucket_cap_mb: float | None) -> float:
    """``bucket_cap_mb`` as a number of MiB, 0 or more; None is torch's default, 25."""
    if bucket_cap_mb is None:
        return 25.0
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
        raise TypeError(f"bucket_cap_mb must be a number of MiB (or None: 25), got "
                        f"{bucket_cap_mb!r}")
    if not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be 0 or more, got {bucket_cap_mb}")
    return bucket_cap_mb
