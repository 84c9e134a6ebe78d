"""``python -m dpcourse.harness.bench fsdp_knobs``: what each of FSDP's knobs costs in memory and
bytes, on our FSDP and on torch's ``fully_shard`` side by side.

Each knob is one configuration of both: the mixed-precision policy (fp32; bf16 parameters with
fp32 reductions; bf16 both ways), ``reshard_after_forward`` (True: ZeRO-3; False: kept from
forward to backward), gradient accumulation over 4 micro-batches (reduce-scatter each, or keep
the full gradients and reduce once) and activation checkpointing (none, or inside each sharded
layer). For each, on every rank, after a warm-up step: the bytes this rank sends in one
optimizer step, and the memory it takes above what it held before the step (its peak), and
between micro-batches.

* **Bytes**: ours are counted message by message (:func:`dpcourse.collectives.count_traffic`);
  torch's collectives are logged (:func:`dpcourse.harness.bench.fsdp.record_collectives`) and
  priced as the course's rings send them: (N-1)/N of an all-gather's output or a
  reduce-scatter's input per rank, twice that for an all-reduce.
* **Memory**: the bytes malloc holds in this process (glibc's ``mallinfo2``: every thread's
  arenas and mapped blocks, which is where torch's CPU tensors live), sampled by a thread every
  0.2 ms and at every layer's forward and backward hooks; the peak above the step's start. It
  sees everything (gathered parameters, gradients, activations, buffers), ours and torch's
  alike, and Python's own small objects too (tens of KiB).

Chapter 11 shows the recorded run (``benchmarks/cpu-2core/fsdp_knobs.json``) and can run it.

Chapter 11: FSDP's knobs measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import threading
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from dpcourse.collectives import count_traffic, ring_all_reduce
from dpcourse.harness.bench.fsdp import record_collectives
from dpcourse.harness.launch import run_ranks
from dpcourse.sharding.fsdp import FSDP

__all__ = ["malloc_bytes", "PeakMemory", "CONFIGS", "knobs_on_rank", "measure_knobs",
           "Checkpointed", "reduction_error_on_rank"]

HELP = "FSDP's knobs (precision, reshard, accumulation, checkpointing): ours and fully_shard"
MICRO = 4  # micro-batches of the accumulation configurations

# name -> (knob, options): "mp" a (param_dtype, reduce_dtype) pair, "reshard" a bool,
# "micro" (sync each micro-batch?), "ac" whether each layer is checkpointed
CONFIGS = {
    "fp32": {},
    "bf16 params, fp32 reduce": {"mp": (torch.bfloat16, torch.float32)},
    "bf16 params, bf16 reduce": {"mp": (torch.bfloat16, torch.bfloat16)},
    "reshard_after_forward=False": {"reshard": False},
    f"{MICRO} micro-batches, sync each": {"micro": True},
    f"{MICRO} micro-batches, no sync": {"micro": False},
    "checkpoint each layer": {"ac": True},
}


# ------------------------------------------------------------------------------- memory
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    if lib is None or not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _MallInfo2
    return lib


_LIBC = _libc()


def malloc_bytes() -> int:
    """Bytes malloc holds for this process now (in use in its arenas, and in blocks it mapped
    apart), every thread's; torch's CPU tensors are among them. Needs glibc 2.33 or later
    (``mallinfo2``); a RuntimeError elsewhere."""
    if _LIBC is None:
        raise RuntimeError("malloc_bytes needs glibc's mallinfo2 (glibc 2.33 or later, Linux)")
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakMemory:
    """The peak of :func:`malloc_bytes` above its value at :meth:`start`, sampled by a thread
    every ``interval`` seconds and whenever :meth:`sample` is called (from hooks)."""

    def __init__(self, interval: float = 2e-4) -> None:
        self.interval = interval
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, *_: object) -> None:
        self.peak = max(self.peak, malloc_bytes() - self.base)

    def now(self) -> int:
        """Bytes above the start, now."""
        return malloc_bytes() - self.base

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> PeakMemory:
        self.base, self.peak = malloc_bytes(), 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return self.peak


def _watch(modules: list[nn.Module], memory: PeakMemory) -> None:
    """Sample at every forward and backward hook of ``modules`` (before FSDP's own post-forward
    hook frees the gathered parameters)."""
    for m in modules:
        m.register_forward_pre_hook(memory.sample)
        m.register_forward_hook(memory.sample, prepend=True)
        m.register_full_backward_pre_hook(memory.sample)
        m.register_full_backward_hook(memory.sample)


# ------------------------------------------------------------------------------ the model
class Checkpointed(nn.Module):
    """``inner``'s forward under activation checkpointing (non-reentrant): its activations are
    not kept; backward runs it again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def make_model(width: int, layers: int, ac: bool = False) -> nn.Sequential:
    """``layers`` blocks, each a Transformer's MLP (Linear ``width`` to ``4 width``, GELU,
    Linear back: 8 width² + 5 width parameters), seeded; each block checkpointed with ``ac``.
    A block keeps 9 activations of ``width`` per sample for its backward (its input, and the
    hidden layer before and after the GELU); checkpointed, only its input."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(layers)]
    return nn.Sequential(*(Checkpointed(b) if ac else b for b in blocks))


def _ring_bytes(log: list[tuple[str, str, int]], world: int) -> int:
    per = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}
    return int(sum(per[kind] * (world - 1) / world * n for what, kind, n in log
                   if what == "collective"))


def _wrap(impl: str, model: nn.Sequential, options: dict):
    """(module, finish the gradients, set gradient sync) for ``impl`` "ours" or "fully_shard"."""
    param, reduce = options.get("mp", (None, None))
    reshard = options.get("reshard", True)
    if impl == "ours":
        policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
        fsdp = FSDP(model, mp_policy=policy, reshard_after_forward=reshard)
        return fsdp, fsdp.finish_gradient_synchronization, fsdp.set_requires_gradient_sync
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model, lambda: None, model.set_requires_gradient_sync


def _one_config(impl: str, options: dict, width: int, layers: int, batch: int) -> dict:
    model = make_model(width, layers, options.get("ac", False))
    blocks = list(model)
    module, finish, set_sync = _wrap(impl, model, options)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)
    world, rank = dist.get_world_size(), dist.get_rank()
    micro = MICRO if "micro" in options else 1
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(batch, width, generator=g) for _ in range(micro)]
    memory = PeakMemory()
    _watch(blocks, memory)
    result: dict = {}
    for measured in (False, True):  # a warm-up step (the optimizer's state), then the step
        opt.zero_grad(set_to_none=True)
        held, forward = [], []
        with contextlib.ExitStack() as stack:
            traffic = stack.enter_context(count_traffic())
            log = stack.enter_context(record_collectives()) if impl == "fully_shard" else []
            if measured:
                memory.start()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for m, x in enumerate(xs):
                    last = m == micro - 1
                    set_sync(last or options.get("micro", True))
                    loss = module(x).float().pow(2).mean() / micro
                    if measured:
                        forward.append(memory.now())
                    loss.backward()
                    if last or options.get("micro", True):
                        finish()
                    if measured:
                        held.append(memory.now())
            if measured:
                result["peak"] = memory.stop()
        opt.step()
        if measured:
            sent = traffic.bytes_sent if impl == "ours" else _ring_bytes(log, world)
            result.update(sent=sent, held=held[:-1], forward=max(forward))
    if impl == "ours":
        module.close()
    return result


def knobs_on_rank(configs: tuple[str, ...] = tuple(CONFIGS), width: int = 512,
                  layers: int = 4, batch: int = 8, ac_batch: int = 256) -> dict:
    """Runs on every rank: for each configuration of :data:`CONFIGS`, ours and ``fully_shard``,
    ``{"sent": bytes sent in one optimizer step, "peak": memory above the step's start,
    "forward": above the start at the end of a forward (the activations kept for backward, and
    the parameters kept gathered), "held": above the start after each micro-batch but the
    last}``. The checkpointing
    configuration (and its baseline, "fp32 (activations)") runs with ``ac_batch`` samples, so
    that the activations show."""
    torch.set_num_threads(1)
    out: dict = {}
    runs = [(name, CONFIGS[name], batch) for name in configs]
    if "checkpoint each layer" in configs:
        runs.append(("fp32 (activations)", {}, ac_batch))
    for name, options, size in runs:
        if name == "checkpoint each layer":
            size = ac_batch
        out[name] = {impl: _one_config(impl, options, width, layers, size)
                     for impl in ("ours", "fully_shard")}
        dist.barrier()
    return out


def measure_knobs(world_size: int = 2, **kwargs) -> dict:
    """:func:`knobs_on_rank` on ``world_size`` ranks: rank 0's figures, and the model's size.
    The ranks run on the host over gloo on every machine: the memory measured is malloc's."""
    result = run_ranks(knobs_on_rank, world_size, backend="gloo", timeout=900, **kwargs)[0]
    width, layers = kwargs.get("width", 512), kwargs.get("layers", 4)
    return {"world_size": world_size, "width": width, "layers": layers,
            "params": layers * (8 * width * width + 5 * width), "batch": kwargs.get("batch", 8),
            "ac_batch": kwargs.get("ac_batch", 256), "micro": MICRO, "results": result}


# ------------------------------------------------------------------- bf16 reductions
def _shifted_batch(offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs on every rank, and targets of their own, shifted down by ``offset`` on
    even ranks and up on odd ones: each rank's gradient grows with the offset, and the shifts
    cancel in the average (of an even number of ranks), as noisy per-rank gradients nearly do
    at a large batch."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1234))
    rank = dist.get_rank()
    y = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    return x, y + (offset if rank % 2 else -offset)


def _shard_grads(impl: str, reduce_dtype: torch.dtype, offset: float) -> torch.Tensor:
    """This rank's rows of the averaged gradient of one backward, flat, in fp32, with the
    gradients reduced in ``reduce_dtype`` (parameters and compute in fp32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    x, y = _shifted_batch(offset)
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
    if impl == "ours":
        module = FSDP(model, mp_policy=policy)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in (0, 2):
                fully_shard(model[i], mesh=mesh, mp_policy=policy)
            module = fully_shard(model, mesh=mesh, mp_policy=policy)
    nn.functional.mse_loss(module(x), y).backward()
    if impl == "ours":
        module.finish_gradient_synchronization()
        grads = [p.grad for p in module.parameters()]
        module.close()
    else:
        grads = [p.grad.to_local() for p in module.parameters()]
    return torch.cat([t.reshape(-1).float() for t in grads])


def reduction_error_on_rank(offsets: tuple[float, ...] = (0.0, 1.0, 10.0, 100.0)) -> list[dict]:
    """Runs on every rank (an even number of them): for each target ``offset`` (the targets of
    odd ranks shifted up by it, of even ranks down), the error of the averaged gradient when it
    is reduced in bf16 instead of fp32, relative to its norm (over every rank's rows), ours and
    ``fully_shard``'s, and how much larger each rank's own gradient is than the average
    (``spread``: the norm of a rank's gradient over the norm of the mean, computed whole)."""
    torch.set_num_threads(1)
    rows = []
    for offset in offsets:
        row = {"offset": offset}
        for impl in ("ours", "fully_shard"):
            exact = _shard_grads(impl, torch.float32, offset)
            rounded = _shard_grads(impl, torch.bfloat16, offset)
            sums = torch.stack([(rounded - exact).pow(2).sum(), exact.pow(2).sum()]).double()
            ring_all_reduce(sums)
            row[impl] = float((sums[0] / sums[1]).sqrt())
        # one rank's own gradient, whole, against the mean's
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        x, y = _shifted_batch(offset)
        nn.functional.mse_loss(model(x), y).backward()
        own = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        mean = own.clone().double()
        ring_all_reduce(mean, "mean")
        row["spread"] = float(own.norm() / mean.norm())
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ac-batch", type=int, default=256)
    parser.add_argument("--reduction-ranks", type=int, default=4,
                        help="ranks of the bf16-reduction measurement (even)")


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    result = measure_knobs(args.world_size, width=args.width, layers=args.layers,
                           batch=args.batch, ac_batch=args.ac_batch)
    result["reduction_ranks"] = args.reduction_ranks
    result["reduction"] = run_ranks(reduction_error_on_rank, args.reduction_ranks,
                                    backend="gloo", timeout=900)[0]
    result["seconds"] = time.perf_counter() - start
    return result


def table(result: dict) -> str:
    """The measured figures as a table (MiB), ours beside ``fully_shard``."""
    mib = 2**20
    lines = [f"{'':30} {'sent':>15}  {'after forward':>15}  {'peak':>15}  "
             f"{'between micro':>15}",
             f"{'configuration (MiB, rank 0)':30} {'ours':>7} {'torch':>7}  {'ours':>7} "
             f"{'torch':>7}  {'ours':>7} {'torch':>7}  {'ours':>7} {'torch':>7}"]
    for name, both in result["results"].items():
        ours, theirs = both["ours"], both["fully_shard"]
        held = [f"{max(r['held']) / mib:7.2f}" if r["held"] else f"{'-':>7}"
                for r in (ours, theirs)]
        lines.append(f"{name:30} {ours['sent'] / mib:7.2f} {theirs['sent'] / mib:7.2f}  "
                     f"{ours['forward'] / mib:7.2f} {theirs['forward'] / mib:7.2f}  "
                     f"{ours['peak'] / mib:7.2f} {theirs['peak'] / mib:7.2f}  "
                     f"{held[0]} {held[1]}")
    return "\n".join(lines)


def report(result: dict) -> None:
    print(f"{result['world_size']} ranks, {result['layers']} MLP blocks of width {result['width']} "
          f"({result['params']:,} parameters), batch {result['batch']} "
          f"({result['ac_batch']} for the activations' rows)")
    print(table(result))
    if "reduction" in result:
        print(f"\ngradients reduced in bf16 instead of fp32, {result['reduction_ranks']} ranks: "
              "error relative to the averaged gradient")
        print(f"{'target offset':>14} {'rank/mean':>10} {'ours':>9} {'fully_shard':>12}")
        for row in result["reduction"]:
            print(f"{row['offset']:14g} {row['spread']:10.1f} {row['ours']:9.2e} "
                  f"{row['fully_shard']:12.2e}")

