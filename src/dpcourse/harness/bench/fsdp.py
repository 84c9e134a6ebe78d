"""``python -m dpcourse.harness.bench fsdp``: our FSDP (ZeRO-3) against torch's FSDP2, and what it
sends.

The benchmark times training steps of the same model, with Adam, in three ways side by side:
torch's ``fully_shard`` on every Linear layer and the root (FSDP2),
:class:`dpcourse.sharding.fsdp.FSDP`
with prefetch, and without. Each step (zero_grad, forward, backward, finishing the gradients,
optimizer step) starts after a barrier and counts as long as its slowest rank; the variants
take turns, and the table shows medians and the ratio to ``fully_shard``. The model is chapter
9's MLP (:func:`dpcourse.harness.bench.zero.make_mlp`), 4 layers of width 1024.

:func:`record_collectives` logs the collectives Python code calls through ``torch.distributed``;
:func:`fsdp_step_events` wraps a model's layers with ``fully_shard``, runs one forward and
backward and returns the collectives between markers of each layer's forward and backward.
Chapter 9's preview of stage 3 uses them; ``tests/test_zero.py`` checks them.

Chapter 9: measuring FSDP.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dpcourse import runtime
from dpcourse.harness.bench import interleaved_step_times
from dpcourse.harness.bench import zero as zero_bench
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device.memory_measurement import optimizer_state_bytes
from dpcourse.sharding.fsdp import FSDP
from dpcourse.sharding.zero import ShardedOptimizer
from dpcourse.timing import DeviceClock

__all__ = ["fully_shard_placement", "record_collectives", "fsdp_step_events", "make_variant",
           "time_on_rank", "timeline_on_rank", "memory_by_stage_on_rank"]

HELP = "FSDP (ZeRO-3) step time: ours with and without prefetch vs torch's fully_shard"
VARIANTS = ("fully_shard", "FSDP", "FSDP no prefetch")
LR = 1e-4

_COLLECTIVES = {  # torch.distributed function -> (what it is, which argument has the full size)
    "all_gather_single": ("all-gather", "output"),
    "all_gather_into_tensor": ("all-gather", "output"),
    "reduce_scatter_single": ("reduce-scatter", "input"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "all_reduce": ("all-reduce", "tensor"),
}


def fully_shard_placement() -> tuple[torch.device, object]:
    """Where torch's ``fully_shard`` runs on this rank, and the ``mesh`` to give it.

    With a GPU per rank (NCCL): the rank's GPU, and None (``fully_shard``'s default mesh: the
    GPUs). Where ranks share GPUs over gloo, ``fully_shard`` on the GPU killed both ranks with
    SIGSEGV (torch 2.11, one H200, 2026-11-26): there it runs on the host, on a CPU mesh over
    gloo, as on a machine without GPUs. Put the model and the batches on the device it returns.
    Chapter 9's FSDP2 cells, its benchmark and the tests use it.
    """
    info = runtime.current()
    if info.backend == "nccl":
        return info.device, None

    return torch.device("cpu"), init_device_mesh("cpu", (info.world_size,))


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, int]]]:
    """Log the collectives that Python code calls through ``torch.distributed`` in the block.

    Yields a list that fills with ``("collective", kind, bytes)``, where bytes is the size of the
    whole tensor (the gathered output, the input that is reduce-scattered); code may append its
    own markers. It sees calls made from Python, as FSDP2's are, not those made from C++ (DDP's
    reducer). Chapter 9 uses it to show what FSDP gathers when.
    """

    log: list[tuple[str, str, int]] = []
    originals = {}

    def wrap(name: str, kind: str, arg: str, original):
        position = 0 if arg in ("output", "tensor") else 1

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            t = kwargs.get(arg, args[position] if len(args) > position else None)
            if isinstance(t, torch.Tensor):
                log.append(("collective", kind, t.numel() * t.element_size()))
            return original(*args, **kwargs)

        return recorded

    for name, (kind, arg) in _COLLECTIVES.items():
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, kind, arg, originals[name]))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def fsdp_step_events(
    model: nn.Module,
    layers: list[str],
    inputs: tuple,
    loss_fn: Callable,
    target: torch.Tensor,
    reshard_root: bool = True,
    mesh=None,
) -> tuple[list[tuple[str, str, int]], int]:
    """Runs on every rank: wrap ``model`` with FSDP2 (``fully_shard`` on each submodule named in
    ``layers``, then on the model, whose group holds the remaining parameters), run one forward
    and backward, and return what happened in order, ``("forward"|"backward", layer, 0)``
    markers between ``("collective", kind, bytes)`` entries, with this rank's number of
    parameter elements after sharding. ``reshard_root``: free the root's gathered parameters
    after forward too (pure ZeRO-3; FSDP's default keeps them for backward). ``mesh``: as
    :func:`fully_shard_placement` returns it, with the model and inputs on its device."""


    modules = dict(model.named_modules())
    with record_collectives() as log, warnings.catch_warnings():
        # FSDP2 warns that a layer returned a view (an in-place op on it would skip its
        # pre-backward hook); nothing here modifies outputs in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")

        def mark_backward(module, args, output, name) -> None:
            # the gradient of the layer's output arrives just before the layer's backward
            output.register_hook(lambda grad: log.append(("backward", name, 0)))

        for name in layers:
            module = modules[name]
            module.register_forward_pre_hook(
                lambda m, args, name=name: log.append(("forward", name, 0))
            )
            module.register_forward_hook(functools.partial(mark_backward, name=name))
            fully_shard(module, mesh=mesh)
        fully_shard(model, reshard_after_forward=reshard_root, mesh=mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
        loss_fn(model(*inputs), target).backward()
    return log, local


# ------------------------------------------------------------------------------ the benchmark
# The same options as bench zero (the same MLP, world sizes, repeats and batch).
add_arguments = zero_bench.add_arguments


def make_variant(name: str, model: nn.Module,
                 mesh=None) -> tuple[nn.Module, Callable[[], None], object]:
    """``(module to call, what finishes the gradients, optimizer)`` for one of :data:`VARIANTS`
    on every rank: torch's ``fully_shard`` on each child with parameters and on the root (on
    ``mesh``: see :func:`fully_shard_placement`), or :class:`dpcourse.sharding.fsdp.FSDP` (with or
    without
    prefetch) on the same children."""


    if name == "fully_shard":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for child in model.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, lambda: None, torch.optim.Adam(model.parameters(), lr=LR)
    if name in ("FSDP", "FSDP no prefetch"):
        fsdp = FSDP(model, prefetch=name == "FSDP")
        return fsdp, fsdp.finish_gradient_synchronization, torch.optim.Adam(fsdp.parameters(),
                                                                            lr=LR)
    raise ValueError(f"unknown variant {name!r}; the variants are {VARIANTS}")


def time_on_rank(variants: tuple[str, ...], repeats: int, warmup: int, batch: int, width: int,
                 out: int) -> dict:
    """Runs on every rank: step times (slowest rank) per variant, interleaved, and under
    ``"device"`` where they ran (:func:`fully_shard_placement`: every variant on the same one)."""


    rank = dist.get_rank()
    # every variant where fully_shard can run: the rank's GPU, or the host where ranks share one
    device, mesh = fully_shard_placement()
    base = zero_bench.make_mlp(width, out).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, out, generator=g).to(device)
    runs = [(name, *make_variant(name, copy.deepcopy(base), mesh)) for name in variants]

    def step(module, finish, opt) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(module(x), y).backward()
        finish()
        opt.step()

    per_step = interleaved_step_times(
        [functools.partial(step, *run[1:]) for run in runs], repeats, warmup, device,
        after_round=lambda i: _check_agreement(runs) if i == 0 else None)
    times: dict = dict(zip(variants, per_step, strict=True))
    for _, module, _, _ in runs:
        if hasattr(module, "close"):
            module.close()
    times["device"] = device.type
    return times


def _check_agreement(runs) -> None:
    """After one step every variant must hold the same weights (they saw the same data): a
    benchmark of a wrong implementation would mean nothing."""
    whole = []
    for _, module, _, _ in runs:
        if hasattr(module, "full_state_dict"):
            state = module.full_state_dict()
        else:
            state = {k: v.full_tensor() for k, v in module.state_dict().items()}
        whole.append(torch.cat([state[k].reshape(-1).float() for k in sorted(state)]))
    for (name, *_), got in zip(runs[1:], whole[1:], strict=True):
        torch.testing.assert_close(got, whole[0], rtol=1e-4, atol=1e-6, msg=f"{name} diverged")


def run(args: argparse.Namespace) -> dict:
    width, out = args.width, args.out_features
    rows = []
    for n in args.world_sizes:
        times = run_ranks(time_on_rank, n, VARIANTS, args.repeats, args.warmup, args.batch,
                          width, out, timeout=1800)[0]
        device = times.pop("device")
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name in VARIANTS:
            rows.append({"world_size": n, "variant": name, "median_s": medians[name],
                         "over_fully_shard": medians[name] / medians["fully_shard"],
                         "device": device})
    return {"num_params": 3 * (width * width + width) + width * out + out,
            "model": f"MLP {width}-{width}-{width}-{width}-{out}", "batch_per_rank": args.batch,
            "repeats": args.repeats, "rows": rows}


def report(result: dict) -> None:
    print(f"Adam on {result['model']} ({result['num_params']:,} parameters), batch "
          f"{result['batch_per_rank']} per rank; median step of {result['repeats']} interleaved "
          "(slowest rank); ratio to torch's fully_shard: lower is faster")
    print(f"{'N':>2} {'variant':<18} {'median':>9} {'/fully_shard':>13}  on")
    for r in result["rows"]:
        print(f"{r['world_size']:>2} {r['variant']:<18} {r['median_s'] * 1e3:>7.1f}ms "
              f"{r['over_fully_shard']:>13.3f}  {r.get('device', '')}")


# --------------------------------------------------------------- what chapter 9 measures
def timeline_on_rank(prefetch: bool, batch: int = 64, width: int = 1024,
                     out: int = 1001) -> list[tuple[str, str, float, float]]:
    """Runs on every rank: record the second training step of the MLP under
    :class:`dpcourse.sharding.fsdp.FSDP` (the first records the layers' order for prefetch), on the
    rank's device. Returns ``(layer, kind, start_s, end_s)`` per event, relative to the step's
    start, where kind is "all-gather" and "reduce-scatter" (on the communication thread),
    "forward" and "backward" (the layer's compute, from its parameters being there to its
    output or last gradient), and "queued" (an instant: when the layer's all-gather was
    submitted). The times are read on a :class:`~dpcourse.timing.DeviceClock`: on a GPU they
    are when the GPU ran the work (CUDA events on the compute stream and on the communication
    thread's streams), not when the host queued it."""


    rank, device = dist.get_rank(), runtime.device()
    fsdp = FSDP(zero_bench.make_mlp(width, out).to(device), prefetch=prefetch)
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, out, generator=g).to(device)
    events: list = []  # (layer, kind, start stamp, end stamp)
    clock = [DeviceClock(device)]

    def now():
        return clock[0].stamp()  # on the calling thread's current stream

    def timed(layer, kind, method):
        def run(*args):
            start = now()
            result = method(*args)
            events.append((layer.name, kind, start, now()))
            return result
        return run

    submit_gather = fsdp._gather

    def queued(layer) -> None:  # when a layer's all-gather is submitted (a prefetch: early)
        if layer.gather is None and not layer.full_bytes():
            at = now()
            events.append((layer.name, "queued", at, at))
        submit_gather(layer)

    fsdp._gather = queued
    began_by_layer: dict[str, dict] = {layer.name: {} for layer in fsdp.layers}
    submit_reduce = fsdp._reduce

    def backward_done(layer) -> None:  # its last gradient is here: before the reduce-scatter
        began = began_by_layer[layer.name]
        if "backward" in began:
            events.append((layer.name, "backward", began.pop("backward"), now()))
        submit_reduce(layer)

    fsdp._reduce = backward_done
    for layer in fsdp.layers:
        layer.all_gather = timed(layer, "all-gather", layer.all_gather)
        layer.reduce_scatter = timed(layer, "reduce-scatter", layer.reduce_scatter)
        began = began_by_layer[layer.name]

        def forward_started(module, args, layer=layer, began=began):
            began["forward"] = now()

        def forward_done(module, args, output, layer=layer, began=began):
            events.append((layer.name, "forward", began["forward"], now()))
            output.register_hook(lambda grad: began.__setitem__("backward", now()))

        layer.module.register_forward_pre_hook(forward_started)  # after FSDP's: gathered
        layer.module.register_forward_hook(forward_done)
    for _ in range(2):
        dist.barrier()
        events.clear()
        clock[0] = DeviceClock(device)  # waits for the device: the step starts on an idle one
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        at = now()
        events.append(("step", "finished", at, at))
        opt.step()
        runtime.synchronize(device)
    fsdp.close()
    seconds = clock[0].seconds
    return sorted(((name, kind, seconds(a), seconds(b)) for name, kind, a, b in events),
                  key=lambda e: e[2])


def memory_by_stage_on_rank(width: int = 1024, out: int = 1001,
                            batch: int = 8) -> dict[int, dict[str, int]]:
    """Runs on every rank: after one Adam step of the MLP, the bytes this rank holds in
    parameters, gradients and optimizer state (counted tensor by tensor; Adam's step counters
    left out) at ZeRO stages 0 (plain data parallelism), 1 and 2 (:class:`~dpcourse.sharding.zero.
    ShardedOptimizer`) and 3 (:class:`~dpcourse.sharding.fsdp.FSDP` with a torch Adam on its
    shards)."""


    g, device = torch.Generator().manual_seed(dist.get_rank()), runtime.device()
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, out, generator=g).to(device)
    held = {}
    for stage in range(4):
        model = zero_bench.make_mlp(width, out).to(device)
        if stage == 3:
            module = FSDP(model)
            opt = torch.optim.Adam(module.parameters(), lr=LR)
        elif stage:
            module, opt = model, ShardedOptimizer(model.parameters(), torch.optim.Adam,
                                                   stage=stage, lr=LR)
        else:
            module, opt = model, torch.optim.Adam(model.parameters(), lr=LR)
        nn.functional.mse_loss(module(x), y).backward()
        if stage == 3:
            module.finish_gradient_synchronization()
        opt.step()
        params = list(module.parameters())
        grads = sum(p.grad.nbytes for p in params if p.grad is not None)
        grads += opt.gradient_bytes() if isinstance(opt, ShardedOptimizer) else 0
        counters = sum(1 for s in opt.state.values() if "step" in s)
        held[stage] = {"parameters": sum(p.nbytes for p in params), "gradients": grads,
                       "optimizer_state": optimizer_state_bytes(opt) - 4 * counters}
        if stage == 3:
            module.close()
    return held
