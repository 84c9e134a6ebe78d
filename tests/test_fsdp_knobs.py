"""Chapter 11's knobs of our FSDP, against themselves and against torch's ``fully_shard``: the
mixed-precision policy, ``reshard_after_forward``, gradient accumulation with and without
synchronisation, and activation checkpointing in both wrap orders. One launch of 2 ranks runs
every training and returns what the tests compare (starting ranks costs seconds).

The model's layers have 7, 9, 6 and 2 rows (uneven on 2 ranks), every layer sharded.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpcourse.collectives import count_traffic
from dpcourse.harness.launch import run_ranks

STEPS = 4
MICRO = 3
LAYERS = ["embed", "block1", "block2", "head"]
FP32_ATOL = 1e-6  # chapter 9's bound: sums in another order, through a few AdamW steps


class Checkpointed(nn.Module):
    """``inner``'s forward under activation checkpointing (recomputed in backward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def make_net(seed: int = 0, ac: str | None = None) -> nn.Module:
    """``ac``: None; "inside" (each sharded unit's inside checkpointed: the recomputation runs
    no hook of the unit); "around" (a checkpoint around the unit ``embed`` and the Tanh after
    it: the recomputation runs the unit's forward hooks, in backward, before the gradient of
    the unit's output arrives)."""
    torch.manual_seed(seed)
    layers = OrderedDict(
        embed=nn.Linear(5, 7),
        act=nn.Tanh(),
        block1=nn.Sequential(nn.Linear(7, 9), nn.Tanh()),
        block2=nn.Sequential(nn.Linear(9, 6), nn.Tanh()),
        head=nn.Linear(6, 2),
    )
    net = nn.Sequential(layers)
    if ac == "inside":
        for name in ("block1", "block2"):
            inner = net.get_submodule(name)
            setattr(net, name, Checkpointed(inner))
    elif ac == "around":
        net = nn.Sequential(OrderedDict(
            first=Checkpointed(nn.Sequential(OrderedDict(embed=net.embed, act=net.act))),
            block1=net.block1, block2=net.block2, head=net.head))
    return net


def names(ac: str | None) -> list[str]:
    return ["first.inner.embed", "block1", "block2", "head"] if ac == "around" else LAYERS


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def unwrapped(state: dict) -> dict:
    """Keys of the checkpointed models as the plain model's."""
    out = {}
    for k, v in state.items():
        k = k.replace("first.inner.", "").replace(".inner.", ".")
        out[k] = v.detach().float().clone()
    return out


def train_ours(*, micro: int = 1, no_sync: bool = False, ac: str | None = None,
               fsdp_class=None, **options) -> tuple[dict, dict]:
    from dpcourse.sharding.fsdp import FSDP

    model = (fsdp_class or FSDP)(make_net(ac=ac), layers=names(ac), **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held, sent = [], []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(s * micro + m, dist.get_rank())
            last = m == micro - 1
            with count_traffic() as t:
                if no_sync and not last:
                    with model.no_sync():
                        (nn.functional.mse_loss(model(x).float(), y) / micro).backward()
                else:
                    (nn.functional.mse_loss(model(x).float(), y) / micro).backward()
                    if no_sync or last:
                        model.finish_gradient_synchronization()
                    else:  # synchronise each micro-batch: its reduce-scatter, added to .grad
                        model.finish_gradient_synchronization()
            held.append(model.unsharded_grad_bytes())
            sent.append(t.bytes_sent)
        opt.step()
    state = unwrapped(model.full_state_dict())
    info = {"calls": dict(model.calls), "held": held, "sent": sent,
            "out_dtype": model(batch(0, 0)[0]).dtype}
    model.close()
    return state, info


def train_torch(*, micro: int = 1, no_sync: bool = False, ac: str | None = None,
                **policy) -> tuple[dict, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dpcourse.harness.bench.fsdp import record_collectives

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = make_net(ac=ac)
    mp = MixedPrecisionPolicy(**policy)
    with warnings.catch_warnings(), record_collectives() as log:
        warnings.simplefilter("ignore")
        for name in names(ac):
            fully_shard(net.get_submodule(name), mesh=mesh, mp_policy=mp)
        fully_shard(net, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for s in range(STEPS):
            opt.zero_grad()
            for m in range(micro):
                x, y = batch(s * micro + m, dist.get_rank())
                net.set_requires_gradient_sync(not no_sync or m == micro - 1)
                (nn.functional.mse_loss(net(x).float(), y) / micro).backward()
            opt.step()
        state = {k: v.full_tensor() for k, v in net.state_dict().items()}
    return unwrapped(state), log


def gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _on_rank() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dpcourse.sharding.fsdp import FSDP

    class Naive(FSDP):
        """Chapter 9's hooks: a recomputation in backward is taken for a forward."""

        def in_backward(self) -> bool:
            return False

    out = {}
    base, info = train_ours()
    out["base_calls"] = info["calls"]
    out["moved"] = gap(base, unwrapped(make_net().state_dict()))
    # mixed precision: the policy as chapter 9's compute_dtype, and reductions in bf16
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    as_ch9, _ = train_ours(compute_dtype=torch.bfloat16)
    policy, info = train_ours(mp_policy=bf16)
    out["policy_vs_compute_dtype"] = gap(policy, as_ch9)
    theirs, _ = train_torch(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["policy_vs_torch"] = gap(policy, theirs)
    low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    ours_low, info = train_ours(mp_policy=low)  # reduce_dtype None: in bf16, as fully_shard
    out["low_out_dtype"] = info["out_dtype"]
    theirs_low, _ = train_torch(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    out["low_vs_torch"] = gap(ours_low, theirs_low)
    out["low_vs_policy"] = gap(ours_low, policy)
    # reshard_after_forward=False: the same training, one all-gather per layer and step
    kept, info = train_ours(reshard_after_forward=False)
    out["kept_vs_base"] = gap(kept, base)
    out["kept_calls"] = info["calls"]
    # accumulation: micro-batches synchronised each, or only the last
    each, info_each = train_ours(micro=MICRO)
    once, info_once = train_ours(micro=MICRO, no_sync=True)
    out["once_vs_each"] = gap(once, each)
    out["each"], out["once"] = info_each, info_once
    torch_once, _ = train_torch(micro=MICRO, no_sync=True)
    out["once_vs_torch"] = gap(once, torch_once)
    # activation checkpointing, both wrap orders, ours and torch's
    for ac in ("inside", "around"):
        state, info = train_ours(ac=ac)
        out[f"ac_{ac}_vs_base"] = gap(state, base)
        out[f"ac_{ac}_calls"] = info["calls"]
        state, log = train_torch(ac=ac)
        out[f"ac_{ac}_torch_vs_base"] = gap(state, base)
        out[f"ac_{ac}_torch_gathers"] = sum(1 for e in log if e[1] == "all-gather")
    state, info = train_ours(ac="around", fsdp_class=Naive)
    out["naive_vs_base"] = gap(state, base)
    out["naive_calls"] = info["calls"]
    _, log = train_torch()
    out["torch_gathers"] = sum(1 for e in log if e[1] == "all-gather")
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_on_rank, 2, backend="gloo", timeout=300)  # the host, on every machine


def test_mixed_precision_policy_reads_as_fully_shard_reads_it(runs):
    for r in runs:
        assert r["moved"] > 1e-2
        # param_dtype bf16, reduce fp32 is chapter 9's compute_dtype=bf16, to the bit
        assert r["policy_vs_compute_dtype"] == 0
        assert r["policy_vs_torch"] <= 1e-6
        # reduce_dtype None means param_dtype (bf16): rounded in the reduction too, not fp32
        assert r["low_vs_policy"] > 0
        assert r["low_vs_torch"] <= 2e-2  # both sum in bf16, in another order
        assert r["low_out_dtype"] == torch.float32


def test_reshard_after_forward_false_trains_the_same_with_one_gather_per_layer(runs):
    steps = STEPS
    for r in runs:
        assert r["kept_vs_base"] == 0
        assert r["base_calls"]["all-gather"] == 2 * len(LAYERS) * steps
        assert r["kept_calls"]["all-gather"] == len(LAYERS) * steps
        assert r["kept_calls"]["reduce-scatter"] == r["base_calls"]["reduce-scatter"]


def test_accumulation_without_sync_keeps_gradients_and_sends_once(runs):
    for r in runs:
        assert r["once_vs_each"] <= FP32_ATOL and r["once_vs_torch"] <= FP32_ATOL
        each, once = r["each"], r["once"]
        assert each["calls"]["reduce-scatter"] == len(LAYERS) * STEPS * MICRO
        assert once["calls"]["reduce-scatter"] == len(LAYERS) * STEPS
        full_grads = sum(p.numel() * 4 for p in make_net().parameters())
        for m in range(MICRO * STEPS):
            last = m % MICRO == MICRO - 1
            # between micro-batches, unsynchronised: the full gradients held, and only the
            # all-gathers sent; the last micro-batch sends what a synchronised one does
            assert once["held"][m] == (0 if last else full_grads)
            assert each["held"][m] == 0
            if last:
                assert once["sent"][m] == each["sent"][m]
            else:
                assert 0 < once["sent"][m] < each["sent"][m]


def test_activation_checkpointing_reuses_the_gathered_parameters(runs):
    for r in runs:
        for ac in ("inside", "around"):
            assert r[f"ac_{ac}_vs_base"] == 0  # recomputed, the same numbers
            assert r[f"ac_{ac}_calls"] == r["base_calls"]  # no extra all-gather
            assert r[f"ac_{ac}_torch_vs_base"] <= FP32_ATOL
            assert r[f"ac_{ac}_torch_gathers"] == r["torch_gathers"]
        # the naive hooks take the recomputation for a forward: they gather the recomputed
        # unit a third time, and prefetch the next unit, whose backward is over (and free
        # both, so that backward gathers the recomputed unit once more): two all-gathers too
        # many per step, the same training
        assert r["naive_vs_base"] == 0
        assert r["naive_calls"]["all-gather"] == r["base_calls"]["all-gather"] + 2 * STEPS
