"""``python -m dpcourse.harness.bench fsdp_offload``: CPU offload, ours and ``fully_shard``'s side
by side: GPU memory per rank, host memory, step time (GPUs only).

Four variants train the same MLP with Adam, one after the other, on each rank's GPU: our FSDP and
``fully_shard``, each without and with ``CPUOffloadPolicy()`` (:class:`dpcourse.sharding.
fsdp_offload.OffloadedFSDP`). For each: the GPU memory the model states hold between steps (what
``torch.cuda.memory_allocated`` grew by from before the model was built), the GPU's peak during
a step above the same base, the bytes of the host tensors among the parameters, gradients and
optimizer state, and the median step (barrier, forward, backward, step, the GPU waited for) over
``--repeats``. Offloading should take the model states off the GPU (4 + 4 + 8 bytes per parameter
over N, fp32 Adam) and put them on the host, and cost the copies over PCIe and a step of Adam on
the CPU.

On a CPU-only machine the host is the device and offloading changes nothing but the copies, so
this refuses to run there; :func:`same_numbers_on_rank` (chapter 11's cell) checks there that the
numbers do not change, and ``tests/test_fsdp_offload.py`` also where each state would live.
``tools/gpu_check.sh`` runs it (on one GPU: one rank, NCCL, since ranks sharing a GPU run gloo,
on which ``fully_shard`` over CUDA crashed).

Chapter 11: what offloading costs, measured where it means something.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from dpcourse import runtime
from dpcourse.harness.bench.fsdp import fully_shard_placement
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device.memory import tensors_in
from dpcourse.sharding.fsdp import FSDP
from dpcourse.sharding.fsdp_offload import OffloadedFSDP

__all__ = ["VARIANTS", "offload_on_rank", "same_numbers_on_rank"]

HELP = "FSDP with and without CPU offload, ours and fully_shard's: GPU and host memory, step time"
VARIANTS = ("ours", "ours, offload", "fully_shard", "fully_shard, offload")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--repeats", type=int, default=5)


def _mlp(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def _wrap(variant: str, model: nn.Sequential) -> nn.Module:
    """``model`` wrapped as ``variant`` says (each Linear a sharded unit): pinned host memory
    where there is a GPU to copy to (a CPU-only build has nothing to pin for)."""
    offload = variant.endswith("offload")
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else None
    if variant.startswith("ours"):
        return OffloadedFSDP(model.to(runtime.device()), offload_policy=policy)
    device, mesh = fully_shard_placement()
    if not offload:  # offloaded, fully_shard wants the parameters on the host to start from
        model.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, offload_policy=policy or OffloadPolicy())
        fully_shard(model, mesh=mesh, offload_policy=policy or OffloadPolicy())
    return model


def _host_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *tensors_in(list(opt.state.values()))]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.nbytes for t in local if not t.is_cuda)


def offload_on_rank(variants: tuple[str, ...] = VARIANTS, width: int = 2048, layers: int = 8,
                    batch: int = 32, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Runs on every rank, each with a GPU: per variant, ``{"held": bytes, "peak": bytes,
    "host": bytes, "step": seconds}`` as the module's docstring says."""
    device = runtime.device()
    if device.type != "cuda":
        raise RuntimeError(f"offload_on_rank measures GPU memory; this rank is on {device}")
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, width, generator=g).to(device)
    out = {}
    for variant in variants:
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        model = _wrap(variant, _mlp(width, layers))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if isinstance(model, FSDP):
                model.finish_gradient_synchronization()
            opt.step()

        for _ in range(2):  # the first records the order, both make the optimizer state
            step()
        times = []
        for _ in range(repeats):
            dist.barrier()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            step()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[variant] = {"held": torch.cuda.memory_allocated(device) - before,
                        "peak": torch.cuda.max_memory_allocated(device) - before,
                        "host": _host_bytes(model, opt), "step": statistics.median(times)}
        if isinstance(model, FSDP):
            model.close()
        del model, opt, step
    return out


def _small_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def same_numbers_on_rank(steps: int = 3, max_norm: float = 0.05) -> dict[str, float]:
    """Runs on every rank, on any machine: a small MLP trained ``steps`` AdamW steps, clipped at
    ``max_norm``, by each of :data:`VARIANTS`. Returns the largest difference of the final
    weights between ours without and with offload (``"ours"``), the same for ``fully_shard``,
    between ours and ``fully_shard`` with offload (fp32 sums in another order), and how far
    training moved the weights at all (``"moved"``)."""
    rank = dist.get_rank()

    def train(variant: str) -> dict[str, torch.Tensor]:
        model = _wrap(variant, _small_mlp())
        ours = isinstance(model, FSDP)
        device = runtime.device() if ours else fully_shard_placement()[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + rank)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            if ours:
                model.finish_gradient_synchronization()
                model.clip_grad_norm_(max_norm)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        if ours:
            state = model.full_state_dict()
            model.close()
        else:
            state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        return {k: v.detach().float().cpu() for k, v in state.items()}

    runs = {v: train(v) for v in VARIANTS}

    def gap(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    return {"ours": gap(runs["ours"], runs["ours, offload"]),
            "fully_shard": gap(runs["fully_shard"], runs["fully_shard, offload"]),
            "ours vs fully_shard": gap(runs["ours, offload"], runs["fully_shard, offload"]),
            "moved": gap(runs["ours"], _small_mlp().state_dict())}


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit(
            "fsdp_offload measures GPU memory and the copies to and from it: it needs GPUs. On a "
            "CPU the host is the device and offloading changes nothing but the copies; "
            "tests/test_fsdp_offload.py checks its numbers and where each state would live.")
    per_rank = run_ranks(offload_on_rank, args.world_size, VARIANTS, args.width, args.layers,
                         args.batch, args.repeats, timeout=600)
    params = args.layers * (args.width * args.width + args.width)
    return {"world_size": args.world_size, "width": args.width, "layers": args.layers,
            "batch_per_rank": args.batch, "params": params, "results": per_rank[0],
            "slowest_step": {v: max(r[v]["step"] for r in per_rank) for v in VARIANTS}}


def report(result: dict) -> None:
    print(f"MLP of {result['layers']} layers of width {result['width']} ({result['params']:,} "
          f"parameters), Adam, {result['world_size']} rank(s): rank 0's memory, the slowest "
          f"rank's median step")
    print(f"{'variant':22} {'GPU held':>10} {'GPU peak':>10} {'host':>10} {'step':>9} "
          f"{'vs fully_shard':>15}")
    res, slow = result["results"], result["slowest_step"]
    for variant, r in res.items():
        theirs = variant.replace("ours", "fully_shard")
        print(f"{variant:22} {r['held'] / 2**20:8.1f} M {r['peak'] / 2**20:8.1f} M "
              f"{r['host'] / 2**20:8.1f} M {slow[variant] * 1e3:7.1f} ms "
              f"{slow[variant] / slow[theirs]:14.2f}x")
