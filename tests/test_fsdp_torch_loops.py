"""Our FSDP in a torch training loop, where the loop relies on every rank seeing the same thing:
fp16 reductions with a ``GradScaler`` (issue 41, item 1) and gradient clipping (item 2), each
against ``fully_shard`` on the same inputs, on 2 and 3 gloo ranks.

* **fp16 reductions.** With ``MixedPrecisionPolicy(param_dtype=torch.float16)`` the gradients are
  reduced in fp16 (``fully_shard``'s rule, which ours follows). Every rank's row-0 gradient of a
  ``Linear(2, 2)`` is 40000: finite on each rank, while their sum (80000 on 2 ranks) is not an
  fp16 number. ``fully_shard`` divides by about sqrt(N) before the sum and by the rest after
  (``_get_gradient_divide_factors``) and gets 40000; summing first gave ``inf`` on the rank that
  owns row 0, finite rows elsewhere, and, since the "not finite" flag was taken before the sum,
  a GradScaler that skipped the step on that rank only.
* **Clipping.** Our shards are plain tensors, so ``torch.nn.utils.clip_grad_norm_`` would take
  each rank's own norm; ``FSDP.clip_grad_norm_`` takes the global one, and the shards' gradients
  refuse a norm taken by torch's utility.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse.harness.bench.fsdp import fully_shard_placement
from dpcourse.harness.bench.fsdp_agreement import clipping_on_rank, fp16_reduction_on_rank
from dpcourse.harness.launch import run_ranks

LAYERS = ["embed", "block1", "block2"]  # the head replicated, where a test says so


def make_net(device=None) -> nn.Module:
    """Layers of 7, 9, 6 and 2 rows: uneven shards on 2 and 3 ranks (test_fsdp.py's model)."""
    from dpcourse import runtime

    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(
        embed=nn.Linear(5, 7),
        block1=nn.Sequential(nn.Linear(7, 9), nn.Tanh()),
        block2=nn.Sequential(nn.Linear(9, 6), nn.Tanh()),
        head=nn.Linear(6, 2),
    ))
    return net.to(device or runtime.device())


def batch(rank: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    from dpcourse import runtime

    g = torch.Generator().manual_seed(rank)
    device = device or runtime.device()
    return torch.randn(4, 5, generator=g).to(device), torch.randn(4, 2, generator=g).to(device)


@pytest.mark.parametrize("world", [2, 3])
def test_an_fp16_sum_that_overflows_is_divided_first_as_fully_shard_divides_it(world):
    """Before issue 41: rank 0 held [[inf, inf]] (the fp16 sum 80000 or 120000), the others
    finite rows, where fully_shard holds [[40000, 40000]] (divided by 2 before the sum)."""
    per_rank = run_ranks(fp16_reduction_on_rank, world, 40000.0, None, timeout=120)
    for rank, r in enumerate(per_rank):
        assert r["ours"]["grad"] == r["fully_shard"]["grad"], (rank, r)
    assert per_rank[0]["ours"]["grad"] == [[40000.0, 40000.0]]


@pytest.mark.parametrize("world", [2, 3])
def test_a_grad_scaler_steps_on_every_rank_or_on_none(world):
    """Scaled by 2**15, each rank's row-0 gradient is 39328 in fp16: finite, but not their sum.
    Before issue 41, rank 0 skipped the step and halved its scale while the others stepped: the
    ranks' scales and weights parted ways. Now every rank steps, as with fully_shard."""
    per_rank = run_ranks(fp16_reduction_on_rank, world, 1.2, 2.0**15, timeout=120)
    for rank, r in enumerate(per_rank):
        ours, theirs = r["ours"], r["fully_shard"]
        assert ours["grad"] == theirs["grad"], (rank, r)
        assert ours["scale"] == theirs["scale"] == 2.0**15, (rank, r)
        assert ours["weight"] == theirs["weight"], (rank, r)
        assert ours["weight"] == per_rank[0]["ours"]["weight"]
    assert per_rank[0]["ours"]["weight"][0][0] < -0.1  # the step was taken


def _overflow_after_the_division_on_rank() -> dict:
    """Each rank's row-0 gradient 60000 on 3 ranks: divided by 2 first, the sum is 90000, not
    fp16 either. fully_shard's owner of row 0 holds inf and its GradScaler, whose "found inf" is
    max-reduced over the mesh (DTensor), makes every rank skip the step; ours must too."""
    return fp16_reduction_on_rank(60000.0, 1.0)


def test_an_overflow_that_remains_makes_every_rank_skip_the_step():
    per_rank = run_ranks(_overflow_after_the_division_on_rank, 3, timeout=120)
    for r in per_rank:
        for impl in ("ours", "fully_shard"):
            assert r[impl]["scale"] == 0.5, r  # skipped and halved, on every rank
            assert r[impl]["weight"] == [[0.0, 0.0], [0.0, 0.0]], r


# ------------------------------------------------------------------------------ clipping
MAX_NORM = 0.05


def _clipping_on_rank(norm_type: float) -> dict:
    """One backward on every rank's batch, then clip at MAX_NORM: the norm and the clipped
    gradients (whole, gathered from the ranks' shards) of ours, of ``fully_shard`` with torch's
    ``clip_grad_norm_``, and of one process on the full batch (what the average must equal);
    and what torch's ``clip_grad_norm_`` does on our shards."""
    from torch.distributed.fsdp import fully_shard

    from dpcourse.sharding.fsdp import FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    single = make_net()
    xs, ys = zip(*(batch(r) for r in range(world)), strict=True)
    nn.functional.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()
    out["single_norm"] = nn.utils.clip_grad_norm_(single.parameters(), MAX_NORM,
                                                  norm_type).item()
    out["single_grads"] = {n: p.grad.clone() for n, p in single.named_parameters()}
    x, y = batch(rank)
    for layers in (None, LAYERS):  # every layer sharded; the head replicated
        fsdp = FSDP(make_net(), layers=layers)
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        try:
            nn.utils.clip_grad_norm_(fsdp.parameters(), MAX_NORM, norm_type)
            out["torch_on_shards"] = "no error"
        except RuntimeError as exc:
            out["torch_on_shards"] = str(exc)
        key = "ours" if layers is None else "ours, head replicated"
        out[key] = fsdp.clip_grad_norm_(MAX_NORM, norm_type).item()
        grads = {}
        for layer in fsdp.layers:
            for name, shard in zip(layer.param_names, layer.shards, strict=True):
                grads[f"{layer.name}.{name}"] = shard.grad.as_subclass(torch.Tensor).clone()
        for name, p in fsdp.module.named_parameters():
            if p.grad is not None and name not in grads:
                grads[name] = p.grad.clone()
        out[f"{key} grads"] = grads  # this rank's rows
        fsdp.close()
    device, mesh = fully_shard_placement()
    net = make_net(device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (*LAYERS, "head"):
            fully_shard(net.get_submodule(name), mesh=mesh)
        fully_shard(net, mesh=mesh)
    nn.functional.mse_loss(net(x.to(device)), y.to(device)).backward()
    if norm_type == float("inf") and world > 2:
        # torch 2.13: the head's 2 rows leave rank 2 an empty shard, whose inf-norm
        # _foreach_norm refuses ("no identity") on that rank alone, and the others wait for it
        out["fully_shard"] = None
    else:
        out["fully_shard"] = nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM,
                                                      norm_type).full_tensor().item()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2-norm", "inf-norm"])
def test_clipping_takes_the_global_norm_of_the_unsharded_model(world, norm_type):
    from dpcourse.collectives.ops import chunk_bounds

    per_rank = run_ranks(_clipping_on_rank, world, norm_type, timeout=120)
    want = per_rank[0]["single_norm"]
    assert want > 4 * MAX_NORM  # the gradients were clipped
    for r in per_rank:
        for key in ("ours", "ours, head replicated", "fully_shard"):
            if r[key] is not None:
                assert r[key] == pytest.approx(want, rel=1e-6), (key, r[key], want)
        assert "fsdp.clip_grad_norm_" in r["torch_on_shards"], r["torch_on_shards"]
    # the clipped gradients are the rows of the unsharded model's clipped gradients
    single = per_rank[0]["single_grads"]
    for rank, r in enumerate(per_rank):
        for key in ("ours grads", "ours, head replicated grads"):
            for name, grad in r[key].items():
                whole = single[name].reshape(single[name].shape[0], -1)
                replicated = key.endswith("replicated grads") and name.startswith("head")
                r0, r1 = (0, len(whole)) if replicated else chunk_bounds(len(whole), world)[rank]
                torch.testing.assert_close(grad.reshape(-1), whole[r0:r1].reshape(-1),
                                           rtol=1e-5, atol=1e-7)


def test_the_chapters_clipping_run_shows_each_ranks_own_norm_short_of_the_global_one():
    per_rank = run_ranks(clipping_on_rank, 2, timeout=120)
    for r in per_rank:
        assert r["ours"] == pytest.approx(r["one process"], rel=1e-6)
        assert r["fully_shard"] == pytest.approx(r["one process"], rel=1e-6)
        assert r["own shards"] < 0.9 * r["one process"]  # a part taken for the whole
        assert "fsdp.clip_grad_norm_" in r["torch on ours"]
    # the parts add up: squares of the ranks' own norms sum to the square of the global one
    assert sum(r["own shards"] ** 2 for r in per_rank) == pytest.approx(
        per_rank[0]["one process"] ** 2, rel=1e-5)
