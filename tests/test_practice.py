"""Chapter 8: learning-rate rules, SyncBatchNorm from scratch, mixed precision, clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpcourse import runtime
from dpcourse.harness.launch import run_ranks
from dpcourse.practice import lr_schedule, mixed_precision, syncbn

TIMEOUT = 120.0


# ------------------------------------------------------------------------------ LR rules
def test_scaled_lr_rules():
    assert lr_schedule.scaled_lr(0.1, 8, "linear") == pytest.approx(0.8)
    assert lr_schedule.scaled_lr(0.1, 16, "sqrt") == pytest.approx(0.4)
    assert lr_schedule.scaled_lr(0.1, 16, "none") == 0.1
    with pytest.raises(ValueError, match="rule must be one of"):
        lr_schedule.scaled_lr(0.1, 2, "cubic")
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        lr_schedule.scaled_lr(0.1, 0)


def test_lr_at_ramps_linearly_then_stays():
    lrs = [lr_schedule.lr_at(s, 0.1, 4, warmup=5) for s in range(8)]
    assert lrs[0] == pytest.approx(0.1) and lrs[5:] == [pytest.approx(0.4)] * 3
    steps = [b - a for a, b in zip(lrs[:5], lrs[1:6], strict=True)]
    assert all(d == pytest.approx(0.06) for d in steps)
    assert lr_schedule.lr_at(0, 0.1, 4, warmup=0) == pytest.approx(0.4)
    assert lr_schedule.lr_at(3, 0.1, 9, warmup=6, rule="sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError, match="must be >= 0"):
        lr_schedule.lr_at(-1, 0.1, 4, 5)


def test_large_batch_run_with_one_rank_is_plain_sgd():
    run = lr_schedule.large_batch_run(1, num_samples=80, per_rank_batch=8)
    assert len(run.losses) == 10 and run.samples[-1] == 80
    assert set(run.lrs) == {0.02}
    with pytest.raises(ValueError, match="less than one batch"):
        lr_schedule.large_batch_run(64, num_samples=100)


@pytest.mark.slow
def test_linear_rule_tracks_the_small_batch_and_no_scaling_falls_behind():
    """The chapter's claim, at N=8 and B=8 (seeded, so deterministic)."""
    one = lr_schedule.large_batch_run(1).final_loss
    runs = {rule: lr_schedule.large_batch_run(8, rule).final_loss for rule in ("none", "linear")}
    assert abs(runs["linear"] - one) < abs(runs["none"] - one)
    assert runs["none"] > 1.5 * one


# ------------------------------------------------------------------------------- SyncBN
def test_stats_from_sums():
    x = torch.randn(37, 3, dtype=torch.float64)
    mean, var, unbiased = syncbn.stats_from_sums(x.sum(0), (x * x).sum(0), 37)
    torch.testing.assert_close(mean, x.mean(0))
    torch.testing.assert_close(var, x.var(0, unbiased=False))
    torch.testing.assert_close(unbiased, x.var(0, unbiased=True))
    with pytest.raises(ValueError, match="at least 2 values"):
        syncbn.stats_from_sums(x[0], x[0] ** 2, 1)


def test_stats_from_moments_combines_uneven_ranks_and_does_not_cancel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64) * 2 + 5
    shards = x.split([1, 6, 9])  # uneven, one rank with a single sample
    means = torch.stack([s.mean(0) for s in shards])
    variances = torch.stack([s.var(0, unbiased=False) for s in shards])
    counts = torch.tensor([len(s) for s in shards])
    mean, var, unbiased = syncbn.stats_from_moments(means, variances, counts)
    torch.testing.assert_close(mean, x.mean(0))
    torch.testing.assert_close(var, x.var(0, unbiased=False))
    torch.testing.assert_close(unbiased, x.var(0, unbiased=True))
    with pytest.raises(ValueError, match="at least 2 values"):
        syncbn.stats_from_moments(means[:1], variances[:1], counts[:1] * 0 + 1)
    # float32, a mean of 1,000 and a spread of 1: the sums lose the variance, the moments keep it
    big = torch.randn(2, 512, 4, generator=g, dtype=torch.float64) + 1000
    truth = big.var(dim=(0, 1), unbiased=False)
    f32 = big.float()
    _, from_sums, _ = syncbn.stats_from_sums(f32.sum((0, 1)), (f32 * f32).sum((0, 1)), 1024)
    per_rank = [torch.var_mean(f32[r], dim=0, unbiased=False) for r in range(2)]
    _, from_moments, _ = syncbn.stats_from_moments(
        torch.stack([m for _, m in per_rank]), torch.stack([v for v, _ in per_rank]),
        torch.tensor([512, 512]))  # fmt: skip
    assert (from_moments.double() - truth).abs().max() < 1e-4
    assert (from_sums.double() - truth).abs().max() > 1e-2


def _syncbn_against_full_batch(shape_tail, sizes, affine, steps=2):
    """Runs on every rank: our SyncBatchNorm on this rank's slice of the batch against
    nn.BatchNorm on the whole batch (computed on every rank, on its device too); returns the
    largest differences."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), runtime.device()
    c = shape_tail[0]
    bn_cls = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}
    bn_cls = bn_cls[len(shape_tail)]
    torch.manual_seed(0)
    full_bn = bn_cls(c, affine=affine, momentum=0.3).to(device)
    if affine:
        with torch.no_grad():
            full_bn.weight.uniform_(0.5, 1.5)
            full_bn.bias.uniform_(-1, 1)
    ours = syncbn.convert_sync_batchnorm(bn_cls(c, affine=affine, momentum=0.3)).to(device)
    ours.load_state_dict(full_bn.state_dict())
    diffs = {"out": 0.0, "dx": 0.0, "dw": 0.0, "running": 0.0}
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = 3 + 2 * torch.randn(sum(sizes), *shape_tail, generator=g, dtype=torch.float32)
        upstream = torch.randn(x.shape, generator=g)  # dL/dout, to test the backward pass
        x, upstream = x.to(device), upstream.to(device)
        xf = x.clone().requires_grad_()
        full_bn(xf).backward(upstream)
        xr = x[start:stop].clone().requires_grad_()
        out = ours(xr)
        out.backward(upstream[start:stop])
        diffs["dx"] = max(diffs["dx"], (xr.grad - xf.grad[start:stop]).abs().max().item())
        if affine:  # this rank's share of the weight gradient; the all-reduce adds them up
            gw = torch.stack([ours.weight.grad, ours.bias.grad])
            dist.all_reduce(gw)
            full_gw = torch.stack([full_bn.weight.grad, full_bn.bias.grad])
            diffs["dw"] = max(diffs["dw"], (gw - full_gw).abs().max().item())
            ours.zero_grad()
            full_bn.zero_grad()
        # the output: the whole batch normalised with its own mean and (biased) variance
        mean = x.transpose(0, 1).reshape(c, -1).mean(1)
        var = x.transpose(0, 1).reshape(c, -1).var(1, unbiased=False)
        view = [1, c] + [1] * (x.dim() - 2)
        ref = (x - mean.view(view)) / torch.sqrt(var.view(view) + full_bn.eps)
        if affine:
            ref = ref * full_bn.weight.detach().view(view) + full_bn.bias.detach().view(view)
        diffs["out"] = max(diffs["out"], (out.detach() - ref[start:stop]).abs().max().item())
    diffs["running"] = max(
        (ours.running_mean - full_bn.running_mean).abs().max().item(),
        (ours.running_var - full_bn.running_var).abs().max().item(),
    )
    # eval mode uses the running statistics, like BatchNorm
    ours.eval()
    full_bn.eval()
    x = torch.randn(4, *shape_tail).to(device)
    diffs["eval"] = (ours(x) - full_bn(x)).abs().max().item()
    return diffs, int(ours.num_batches_tracked)


@pytest.mark.parametrize(
    "world,shape_tail,sizes,affine",
    [
        (2, (3,), [5, 5], True),  # BatchNorm1d on (B, C)
        (3, (4, 7), [2, 5, 3], True),  # (B, C, L), uneven batches
        (2, (2, 3, 5), [1, 4], False),  # BatchNorm2d, one sample on a rank, no affine
        (4, (3, 2, 2, 3), [2, 2, 2, 2], True),  # BatchNorm3d
    ],
)
def test_syncbn_equals_batchnorm_on_the_whole_batch(world, shape_tail, sizes, affine):
    results = run_ranks(
        _syncbn_against_full_batch, world, shape_tail, sizes, affine, timeout=TIMEOUT
    )
    # Measured here: at most 9.5e-7 (out, running), 6e-7 (dx), 4.3e-6 (dw), a few float32 steps
    # at values up to ~10; a GPU (cuDNN's and NCCL's summation orders) rounds by as many steps.
    for diffs, tracked in results:
        assert tracked == 2
        assert diffs["out"] < 1e-5 and diffs["dx"] < 1e-5, diffs
        assert diffs["dw"] < 1e-4 and diffs["running"] < 1e-5 and diffs["eval"] < 1e-5, diffs


def _plain_bn_differs():
    """Plain BatchNorm on each rank's half: the statistics are the rank's own, not the batch's."""
    import torch.distributed as dist

    rank, device = dist.get_rank(), runtime.device()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g) + torch.arange(8.0).unsqueeze(1)  # halves differ
    x = x.to(device)
    mine = x[rank * 4 : (rank + 1) * 4]
    full = nn.BatchNorm1d(3).to(device)(x)[rank * 4 : (rank + 1) * 4]
    plain = nn.BatchNorm1d(3).to(device)(mine)
    synced = syncbn.SyncBatchNorm(3).to(device)(mine)
    return (plain - full).abs().max().item(), (synced - full).abs().max().item()


def test_plain_batchnorm_per_rank_differs_from_sync():
    for plain, synced in run_ranks(_plain_bn_differs, 2, timeout=TIMEOUT):
        assert plain > 0.1 and synced < 1e-5


def test_syncbn_without_process_group_is_batchnorm_and_checks_input():
    x = torch.randn(6, 4, 5)
    torch.manual_seed(1)
    bn = nn.BatchNorm1d(4)
    ours = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)))[0]
    assert isinstance(ours, syncbn.SyncBatchNorm)
    torch.testing.assert_close(ours(x), bn(x))
    torch.testing.assert_close(ours.running_var, bn.running_var)
    with pytest.raises(ValueError, match="channel dimension is 1"):
        ours(torch.randn(6, 5, 4))
    with pytest.raises(ValueError, match=r"\(B, C, \.\.\.\)"):
        ours(torch.randn(4))


def test_torch_syncbatchnorm_needs_a_gpu_on_this_torch():
    """Why the course has its own: torch's refuses CPU tensors (if that changes, update ch. 8)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")

    def try_torch():
        try:
            nn.SyncBatchNorm(3)(torch.randn(4, 3))
        except ValueError as exc:
            return str(exc)
        return "worked"

    assert all("GPU" in m for m in run_ranks(try_torch, 2, timeout=TIMEOUT))


# ------------------------------------------------------------------------- mixed precision
def test_underflow_fraction_fp16_and_bf16():
    values = torch.logspace(-12, -2, 101, dtype=torch.float64)
    below = (values < mixed_precision.FP16_SMALLEST_SUBNORMAL / 2).double().mean().item()
    assert mixed_precision.underflow_fraction(values, torch.float16) == pytest.approx(below)
    assert mixed_precision.underflow_fraction(values, torch.float16, scale=2.0**16) < below / 2
    assert mixed_precision.underflow_fraction(values, torch.bfloat16) == 0.0
    with pytest.raises(ValueError, match="no non-zero"):
        mixed_precision.underflow_fraction(torch.zeros(3), torch.float16)


def test_fp16_autocast_gradients_vanish_without_a_scaler():
    assert mixed_precision.autocast_gradient_zeros(torch.float16, scaler=False) == 1.0
    assert mixed_precision.autocast_gradient_zeros(torch.float16, scaler=True) < 0.01
    assert mixed_precision.autocast_gradient_zeros(torch.bfloat16, scaler=False) < 0.01


def test_clip_after_the_all_reduce_equals_single_device():
    for world in (2, 4):
        for r in run_ranks(mixed_precision.clipping_order_on_rank, world, timeout=TIMEOUT):
            for a, b in zip(r["single"], r["reduce_then_clip"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            worst = max(
                (a - b).abs().max().item()
                for a, b in zip(r["single"], r["clip_then_reduce"], strict=True)
            )
            assert worst > 1e-3  # clipping each rank's gradient first is another update


def test_unscale_after_the_all_reduce_keeps_ranks_in_step():
    right = run_ranks(mixed_precision.inf_on_one_rank, 2, "reduce_then_unscale", timeout=TIMEOUT)
    assert [r["stepped"] for r in right] == [False, False]
    assert torch.equal(right[0]["weight"], right[1]["weight"])
    assert right[0]["scale"] == right[1]["scale"] == 2.0**15
    wrong = run_ranks(mixed_precision.inf_on_one_rank, 2, "unscale_then_reduce", timeout=TIMEOUT)
    assert [r["stepped"] for r in wrong] == [True, False]
    assert not torch.isfinite(wrong[0]["weight"]).all()
    assert not math.isclose(wrong[0]["scale"], wrong[1]["scale"])


def test_noam_schedule_rises_peaks_and_decays_and_drives_lambda_lr():
    lrs = [lr_schedule.noam_lr(s, d_model=512, warmup=100) for s in range(1000)]
    assert lrs[0] > 0  # the first step moves the weights
    assert max(range(1000), key=lrs.__getitem__) == 99
    assert lrs[99] == pytest.approx((512 * 100) ** -0.5)
    assert lrs[399] == pytest.approx(lrs[99] / 2)  # 1/sqrt(s): s = 400 is 4 x 100
    assert lrs[49] == pytest.approx(lrs[99] / 2)  # linear before the peak: s = 50 is half
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_schedule.noam_lr(s, 512, 100))
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs[:5])
    with pytest.raises(ValueError, match="warmup >= 1"):
        lr_schedule.noam_lr(0, 512, 0)
