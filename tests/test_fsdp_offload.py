"""CPU offload for our FSDP (dpcourse.sharding.fsdp_offload), as far as a CPU can tell.

On this machine the host is the device, so offloading moves nothing; what a CPU can check:

* **the same numbers**: with ``offload_policy=CPUOffloadPolicy(pin_memory=False)`` ours trains to
  the bit as without, and as ``fully_shard`` with and without the same policy (which runs on a CPU
  mesh too), on 3 ranks; clipping gives the same norm;
* **where each state would live on a GPU machine**: under the device audit (a GPU per rank,
  NCCL: every tensor tagged "device" or "host", an operation mixing them fails as CUDA would), the
  shards, their gradients and AdamW's state are host tensors, the gathered layer a device one,
  the replicated head a device one, and a training step runs without a device error.

What it costs on a GPU (the copies over PCIe, the optimizer on the CPU, the device memory saved)
needs one: ``python -m dpcourse.harness.bench fsdp_offload``, run by ``tools/gpu_check.sh``.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse.harness import device_audit
from dpcourse.harness.launch import RankPool, run_ranks

LAYERS = ["embed", "block1", "block2"]  # the head replicated


def make_net(device=None) -> nn.Module:
    from dpcourse import runtime

    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(
        embed=nn.Linear(5, 7), block1=nn.Sequential(nn.Linear(7, 9), nn.Tanh()),
        block2=nn.Sequential(nn.Linear(9, 6), nn.Tanh()), head=nn.Linear(6, 2)))
    return net.to(device or runtime.device())


def batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 5, generator=g).to(device), torch.randn(4, 2, generator=g).to(device)


def _train_ours(offload: bool, steps: int = 3) -> tuple[dict, float]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from dpcourse import runtime
    from dpcourse.sharding.fsdp_offload import OffloadedFSDP

    policy = CPUOffloadPolicy(pin_memory=False) if offload else None
    fsdp = OffloadedFSDP(make_net(), layers=LAYERS, offload_policy=policy)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = batch(s, runtime.device())
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        norm = fsdp.clip_grad_norm_(0.05).item()
        opt.step()
    state = fsdp.full_state_dict()
    fsdp.close()
    return {k: v.detach().cpu() for k, v in state.items()}, norm


def _offloaded_clip_on_rank() -> tuple[float, float]:
    """The norm FSDP.clip_grad_norm_ clips by after 3 steps (the head replicated), without and
    with offload."""
    return _train_ours(False)[1], _train_ours(True)[1]


def test_offloaded_fsdp_trains_to_the_bit_as_without():
    """On 3 ranks, whose shards are uneven (chapter 11's cell runs 2)."""
    from dpcourse.harness.bench.fsdp_offload import same_numbers_on_rank

    world = 3
    for r in run_ranks(same_numbers_on_rank, world, timeout=180):
        assert r["moved"] > 1e-3  # it trained
        assert r["ours"] == 0.0 and r["fully_shard"] == 0.0, r  # torch's changes nothing either
        assert r["ours vs fully_shard"] <= 1e-6, r  # fp32, summed in another order
    for plain, offloaded in run_ranks(_offloaded_clip_on_rank, world, timeout=180):
        assert plain == offloaded


def _where_on_rank() -> dict:
    """Under the audit: where each of FSDP's tensors would live on a GPU machine, offloaded or
    not, after a training step (and the gathered layer during its forward)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from dpcourse import runtime
    from dpcourse.sharding.fsdp_offload import OffloadedFSDP

    assert device_audit.enabled()
    seen = {}
    for offload in (False, True):
        policy = CPUOffloadPolicy() if offload else None  # pin_memory: skipped without a GPU
        fsdp = OffloadedFSDP(make_net(), layers=LAYERS, offload_policy=policy)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        during: dict[str, str] = {}

        def gathered(module, args, during=during) -> None:
            during["gathered"] = device_audit.where(module.weight)

        block1 = fsdp.module.block1[0]
        block1.register_forward_pre_hook(gathered)
        x, y = batch(0, runtime.device())
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        shard = block1.weight  # the shard is back in the module
        seen[offload] = {
            "shard": device_audit.where(shard), "grad": device_audit.where(shard.grad),
            "exp_avg": device_audit.where(opt.state[shard]["exp_avg"]),
            "head": device_audit.where(fsdp.module.head.weight), **during}
        fsdp.close()
    # a model built on meta: its shards are made on the device, then offloaded
    fsdp = OffloadedFSDP(make_net("meta"), layers=LAYERS, offload_policy=CPUOffloadPolicy())
    fsdp.materialize(runtime.device(), lambda name, shape, r0, r1: torch.ones(r1 - r0, *shape[1:]))
    seen["meta"] = {device_audit.where(p) for layer in fsdp.layers for p in layer.shards}
    fsdp.close()
    return seen


def test_where_each_state_lives_on_a_gpu_machine():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(device_audit.ENV, "1")
        with RankPool(2) as pool:
            per_rank = pool.run(_where_on_rank, timeout=120)
    for seen in per_rank:
        assert seen[False] == {"shard": "device", "grad": "device", "exp_avg": "device",
                               "head": "device", "gathered": "device"}, seen
        assert seen[True] == {"shard": "host", "grad": "host", "exp_avg": "host",
                              "head": "device", "gathered": "device"}, seen
        assert seen["meta"] == {"host"}, seen


def test_an_offload_policy_of_another_kind_is_refused():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from dpcourse.sharding.fsdp_offload import offloads

    assert offloads(CPUOffloadPolicy()) and not offloads(OffloadPolicy()) and not offloads(None)
    with pytest.raises(TypeError, match="CPUOffloadPolicy"):
        offloads("cpu")


def test_the_offload_benchmark_refuses_a_cpu_and_reports_ratios(capsys):
    """The measurement needs a GPU (tools/gpu_check.sh runs it); its report, on made-up
    numbers."""
    import argparse

    from dpcourse.harness.bench import fsdp_offload

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs GPUs"):
            fsdp_offload.run(argparse.Namespace(world_size=1, width=8, layers=1, batch=2,
                                                repeats=1))
    one = {"held": 2**20, "peak": 2**21, "host": 0, "step": 0.01}
    result = {"world_size": 1, "width": 8, "layers": 1, "batch_per_rank": 2, "params": 72,
              "results": {v: one for v in fsdp_offload.VARIANTS},
              "slowest_step": {v: 0.01 * (2 if "offload" in v and "ours" in v else 1)
                               for v in fsdp_offload.VARIANTS}}
    fsdp_offload.report(result)
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].split()[-1] == "2.00x" and lines[2].split()[-1] == "1.00x", lines


@pytest.mark.gpu
def test_offload_takes_the_model_states_off_the_gpu():
    """On one GPU: ours and fully_shard, each with CPUOffloadPolicy, hold far less GPU memory
    between steps than without, and the host holds the model states."""
    from dpcourse.harness.bench.fsdp_offload import offload_on_rank

    r = run_ranks(offload_on_rank, 1, width=1024, layers=4, batch=8, repeats=2, timeout=300)[0]
    params = 4 * (1024 * 1024 + 1024)
    for impl in ("ours", "fully_shard"):
        plain, offloaded = r[impl], r[f"{impl}, offload"]
        assert plain["held"] >= 12 * params and plain["host"] == 0, r  # 4 + 4 + 8 bytes, less
        assert offloaded["held"] < 0.25 * plain["held"], r
        assert offloaded["host"] >= 12 * params, r
