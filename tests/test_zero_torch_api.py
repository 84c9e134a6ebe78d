"""ShardedOptimizer as a torch optimizer (issue 18): in a torch-style loop with an LR scheduler,
a GradScaler, gradient clipping, gradient accumulation (with and without ``no_sync``), a group
added later, and a consolidated state dict, against the same loop unsharded (gradients averaged
as DDP averages them). One run of the rank-side checks per world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from dpcourse import runtime
from dpcourse.harness.launch import run_ranks
from dpcourse.sharding.zero import ShardedOptimizer

RTOL, ATOL = 1e-5, 1e-6  # as tests/test_zero.py: float32 sums in another order, through Adam
# On a GPU too: these loops (warm-up, clipping at 0.05) nudged one float step in every weight and
# gradient (zero_bench.NUDGED) end at most 6e-8 apart on 2 and 3 ranks (this CPU), ATOL / 16.
STEPS = 6


def make_model(seed: int = 0) -> nn.Module:
    """The model, on the rank's device (a GPU where there is one)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 5))  # 71 parameters
    return net.to(runtime.device())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    device = runtime.device()
    return torch.randn(8, 5, generator=g).to(device), torch.randn(8, 5, generator=g).to(device)


def average(model: nn.Module) -> None:
    """DDP's work on the reference: every gradient all-reduced and divided by N."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def loop(model, opt, *, sharded, scaler=None, clip=None, poison_step=None, steps=STEPS):
    """A torch-style loop: zero_grad, (scaled) backward, unscale, clip, step, update, schedule.
    ``poison_step``: on that step rank 1's gradient of the last bias overflows (inf), five
    elements that only the last rank owns, as one rank's fp16 overflow would."""
    rank = dist.get_rank()
    scheduler = LambdaLR(opt, warmup)
    norms, scales = [], []
    for s in range(steps):
        x, y = batch(s, rank)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        hook = None
        if s == poison_step and rank == 1:
            hook = model[2].bias.register_hook(lambda g: g * float("inf"))
        (scaler.scale(loss) if scaler else loss).backward()
        if hook is not None:
            hook.remove()
        if not sharded:
            average(model)
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            norm = (opt.clip_grad_norm_(clip) if sharded
                    else nn.utils.clip_grad_norm_(model.parameters(), clip))
            norms.append(float(norm))
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        scheduler.step()
    params = [p.detach().clone() for p in model.parameters()]
    return params, norms, scales, [g["lr"] for g in opt.param_groups]


def gap(a, b) -> float:
    a, b = [x.cpu() for x in a], [y.cpu() for y in b]  # the rank's device, or the host
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL)
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def three_steps(ref, ref_opt, model, opt) -> None:
    """Three plain steps of the reference (gradients averaged as DDP would) and of ``model``
    with the ShardedOptimizer ``opt``, on the same batches."""
    rank = dist.get_rank()
    for m, o, sharded in ((ref, ref_opt, False), (model, opt, True)):
        for s in range(3):
            x, y = batch(s, rank)
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            if not sharded:
                average(m)
            o.step()


def _checks_on_rank(stage: int) -> dict:
    rank = dist.get_rank()
    out: dict = {}
    adamw = dict(lr=1e-2, weight_decay=0.1)

    def pair(**kw):
        ref, model = make_model(), make_model()
        want = loop(ref, torch.optim.AdamW(ref.parameters(), **adamw), sharded=False,
                    scaler=kw.get("ref_scaler"), clip=kw.get("clip"),
                    poison_step=kw.get("poison_step"))
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **adamw)
        got = loop(model, opt, sharded=True, scaler=kw.get("scaler"), clip=kw.get("clip"),
                   poison_step=kw.get("poison_step"))
        return want, got, opt

    # An LR scheduler (warm-up) drives it as it drives the unsharded optimizer.
    want, got, opt = pair()
    out["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    out["lambda_lr"] = gap(got[0], want[0])
    out["lrs"] = (got[3], want[3])

    # GradScaler, with an overflow on rank 1 only at step 2: every rank skips that step.
    # (Without reduce_gradients' NaN in every slice, only the last rank would skip: a hang.)
    device_type = runtime.device().type  # "cuda" on a GPU
    scalers = [torch.amp.GradScaler(device_type, init_scale=2.0**12) for _ in range(2)]
    want, got, _ = pair(ref_scaler=scalers[0], scaler=scalers[1], poison_step=2)
    out["grad_scaler"] = gap(got[0], want[0])
    out["scales"] = (got[2], want[2])

    # Clipping on the global norm of the averaged gradients (small max_norm: it clips).
    want, got, _ = pair(clip=0.05)
    out["clip"] = gap(got[0], want[0])
    out["norms"] = (got[1], want[1])

    # Gradient accumulation: two backward passes add up, with or without no_sync (stage 1's
    # .grad are views of the flat buffer while they stay on the rank).
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (x0, y0), (x1, y1) = batch(0, rank), batch(1, rank)
    (nn.functional.mse_loss(ref(x0), y0) + nn.functional.mse_loss(ref(x1), y1)).backward()
    average(ref)
    ref_opt.step()
    for how in ("no_sync", "twice"):
        model = make_model()
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
        if how == "no_sync":
            with opt.no_sync():
                nn.functional.mse_loss(model(x0), y0).backward()
            flat = opt._groups[0].grad
            out["views_in_no_sync"] = stage == 2 or all(
                flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.nbytes
                for p in model.parameters()
            )
        else:
            nn.functional.mse_loss(model(x0), y0).backward()
            out["freed_after_backward"] = all(p.grad is None for p in model.parameters())
        nn.functional.mse_loss(model(x1), y1).backward()
        opt.step()
        out[f"accumulate_{how}"] = gap(list(model.parameters()), list(ref.parameters()))

    # A group added after construction, as on a torch optimizer.
    ref, model = make_model(), make_model()
    ref_opt = torch.optim.AdamW(list(ref[0].parameters()), **adamw)
    ref_opt.add_param_group({"params": list(ref[2].parameters()), "lr": 3e-2})
    opt = ShardedOptimizer(list(model[0].parameters()), torch.optim.AdamW, stage=stage, **adamw)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 3e-2})
    three_steps(ref, ref_opt, model, opt)
    out["add_param_group"] = gap(list(model.parameters()), list(ref.parameters()))
    try:
        opt.add_param_group({"params": list(model[0].parameters())})
        out["twice"] = None
    except ValueError as exc:
        out["twice"] = str(exc)

    # consolidate_state_dict: on rank 0 the state of an unsharded AdamW over model.parameters()
    # (a frozen layer included); it loads into one, and stepping on from it is the same.
    ref, model = make_model(), make_model()
    ref[0].requires_grad_(False)
    model[0].requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), **adamw)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **adamw)
    three_steps(ref, ref_opt, model, opt)
    full = opt.consolidate_state_dict(to=0)
    out["consolidated_elsewhere"] = full is None if rank else None
    if rank == 0:
        want = ref_opt.state_dict()
        out["consolidated_keys"] = (sorted(full["state"]), sorted(want["state"]))
        out["consolidated_groups"] = [g["params"] for g in full["param_groups"]]
        out["consolidated"] = max(
            (full["state"][i][k].cpu() - want["state"][i][k].cpu()).abs().max().item()
            for i in want["state"] for k in ("exp_avg", "exp_avg_sq")
        )
        plain = torch.optim.AdamW(model.parameters(), lr=0.5)
        plain.load_state_dict(full)
        out["loaded_lr"] = plain.param_groups[0]["lr"]
    return out


@pytest.fixture(scope="module", params=[(2, 1), (3, 2)], ids=["2 ranks stage 1", "3 ranks stage 2"])
def results(request):
    world, stage = request.param
    return world, run_ranks(_checks_on_rank, world, stage, timeout=180)


def test_it_is_a_torch_optimizer_that_an_lr_scheduler_drives(results):
    for r in results[1]:
        assert r["is_optimizer"] and r["lambda_lr"] <= ATOL + RTOL
        got, want = r["lrs"]
        assert got == pytest.approx(want) and got[0] == pytest.approx(1e-2)  # warmed up


def test_grad_scaler_skips_the_overflowing_step_on_every_rank(results):
    for r in results[1]:
        assert r["grad_scaler"] <= ATOL + RTOL
        got, want = r["scales"]
        assert got == want and want[2] == want[1] / 2  # step 2 overflowed: the scale halved


def test_clipping_uses_the_global_norm(results):
    for r in results[1]:
        assert r["clip"] <= ATOL + RTOL
        got, want = r["norms"]
        assert got == pytest.approx(want, rel=1e-5) and min(want) > 0.05  # it did clip


def test_gradient_accumulation_with_and_without_no_sync(results):
    for r in results[1]:
        assert r["accumulate_no_sync"] <= ATOL + RTOL and r["accumulate_twice"] <= ATOL + RTOL
        assert r["views_in_no_sync"] and r["freed_after_backward"]


def test_add_param_group(results):
    for r in results[1]:
        assert r["add_param_group"] <= ATOL + RTOL
        assert "already in another group" in r["twice"]


def test_consolidated_state_dict_loads_into_the_unsharded_optimizer(results):
    world, per_rank = results
    r = per_rank[0]
    assert r["consolidated_keys"][0] == r["consolidated_keys"][1] == [2, 3]  # layer 0 frozen
    assert r["consolidated_groups"] == [[0, 1, 2, 3]]
    assert r["consolidated"] < 1e-6 and r["loaded_lr"] == 1e-2
    assert all(r["consolidated_elsewhere"] for r in per_rank[1:])
