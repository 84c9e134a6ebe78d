"""Chapter 12's implementations against PyTorch's, torchft's and one-process references.

Tolerances, and why:

* fp16/bf16 hooks, local SGD: the same operations on the same tensors in the same order as
  torch's, so the results are equal to the bit (``torch.equal``).
* PowerSGD, rank 1 and 2: the same draws and the same Gram-Schmidt as torch's hook; its matrix
  products run as ``bmm`` on (1, n, m) views, ours as ``matmul``, which on the CPU may sum in
  another order: a few float32 ulps per product, 1e-6 of the gradient's scale.
* PowerSGD, rank 4: torch orthogonalises by QR above rank 2 (Householder), ours by Gram-Schmidt;
  the same subspace, columns equal up to sign and rounding, and P Q^T does not depend on the
  signs. Measured: 6e-7 of the gradient's scale over 6 steps with error feedback; allowed 1e-5
  (float32's rounding of the orthogonalisation, amplified by how ill-conditioned P can be).
* DiLoCo and Streaming DiLoCo against torchft's: the same all-reduce (gloo's sum, divided by N)
  on the same tensors: to the bit. Against the one-process references, which average with
  ``stack().mean()`` where gloo sums in its own order: a few ulps a round, 1e-5 after AdamW
  (whose division by sqrt(v) magnifies last-bit differences of tiny gradients) over 4 rounds.
* On a GPU the same hooks run on CUDA buffers (NCCL or gloo); ``tests/test_gpu.py`` does not
  cover them yet: ``tools/gpu_check.sh`` runs this file (see its notes).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

from dpcourse.communicating_less import (
    compression,
    diloco,
    local_sgd,
    powersgd,
    quantization,
    step_model,
    streaming_diloco,
)
from dpcourse.cost import costmodel, scaling
from dpcourse.ddp.buckets import BucketManager, HookBucket
from dpcourse.ddp.ddp import DDP
from dpcourse.harness.launch import RankError, run_ranks
from dpcourse.replicas.parameter_averaging import train_parameter_averaging

WORLDS = (2, 3, 4)
# awkward shapes: vectors, a matrix smaller than rank 4, a conv kernel, two equal shapes apart,
# and one matrix that rank 4 compresses ((32 + 24) x 4 x 2 < 768)
SHAPES = [(16, 8), (5,), (3, 2), (4, 3, 3, 3), (8,), (16, 8), (1, 12), (32, 24), (12, 10)]


def gradient_bucket(seed: int, shapes=SHAPES) -> BucketManager:
    """One bucket holding gradients of ``shapes`` drawn from ``seed``."""
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    reducer = BucketManager(params, 2**30, dist.get_world_size())
    g = torch.Generator().manual_seed(seed)
    reducer.buckets[0].buffer.copy_(torch.randn(reducer.buckets[0].buffer.shape, generator=g))
    return reducer


def hooks_on_rank() -> dict:
    rank = dist.get_rank()
    pairs = {"allreduce": (compression.allreduce_hook, default_hooks.allreduce_hook),
             "fp16": (compression.fp16_compress_hook, default_hooks.fp16_compress_hook),
             "bf16": (compression.bf16_compress_hook, default_hooks.bf16_compress_hook)}
    equal = {}
    for name, (ours, theirs) in pairs.items():
        a, b = gradient_bucket(rank), gradient_bucket(rank)
        got = ours(None, HookBucket(a.buckets[0], 1)).wait()
        want = theirs(None, HookBucket(b.buckets[0], 1)).wait()
        equal[name] = torch.equal(got, want) and got.data_ptr() == a.buckets[0].buffer.data_ptr()
    return equal


@pytest.mark.parametrize("world", WORLDS)
def test_compression_hooks_equal_torchs(world):
    for equal in run_ranks(hooks_on_rank, world, backend="gloo", timeout=120):
        assert all(equal.values()), equal


def powersgd_on_rank(rank_r: int, feedback: bool, warm: bool, steps: int = 6) -> float:
    """The largest difference between ours and torch's PowerSGD over ``steps`` steps, each a
    fresh gradient per rank, relative to the gradients' scale."""
    options = dict(matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                   use_error_feedback=feedback, warm_start=warm, random_seed=3)
    ours, theirs = powersgd.PowerSGDState(**options), torch_powersgd.PowerSGDState(None, **options)
    worst = 0.0
    for step in range(steps):
        a, b = (gradient_bucket(100 * step + dist.get_rank()) for _ in range(2))
        scale = a.buckets[0].buffer.abs().max().item()
        got = powersgd.powersgd_hook(ours, HookBucket(a.buckets[0], 1)).wait()
        want = torch_powersgd.powerSGD_hook(theirs, HookBucket(b.buckets[0], 1)).wait()
        worst = max(worst, (got - want).abs().max().item() / scale)
    assert ours.iter == theirs.iter == steps
    return worst


@pytest.mark.parametrize("world", WORLDS)
def test_powersgd_equals_torchs(world):
    for rank_r, feedback, warm in ((1, True, True), (2, True, True), (1, False, True),
                                   (2, True, False)):
        worst = max(run_ranks(powersgd_on_rank, world, rank_r, feedback, warm,
                              backend="gloo", timeout=120))
        assert worst < 1e-6, (rank_r, feedback, warm, worst)
    assert max(run_ranks(powersgd_on_rank, world, 4, True, True, backend="gloo")) < 1e-5


def test_powersgd_compresses_what_gains_and_keeps_its_error():
    assert powersgd.compressed_values((16, 8), 1) == 24  # (16 + 8) x 1 of 128
    assert powersgd.compressed_values((5,), 1) == 5  # a vector: sent whole
    assert powersgd.compressed_values((3, 2), 4) == 6  # (3 + 2) x 2 x 2 >= 6: whole
    assert powersgd.compressed_values((4, 3, 3, 3), 1) == 4 + 27  # (4 + 27) x 2 < 108
    assert powersgd.compressed_values((4, 3, 3, 3), 2) == 108  # (4 + 27) x 2 x 2 >= 108
    m = torch.randn(9, 3)
    powersgd.orthogonalize(m)
    assert torch.allclose(m.t() @ m, torch.eye(3), atol=1e-5)
    with pytest.raises(ValueError, match="start_powerSGD_iter must be 2"):
        powersgd.PowerSGDState(start_powerSGD_iter=1)


def train_with_hooks_on_rank(steps: int = 5) -> dict:
    """The same training under torch's DDP and ours, each with torch's hook and ours."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
                         nn.Linear(12, 1))
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g))
               for g in (torch.Generator().manual_seed(10 * s + rank) for s in range(steps))]
    weights = {}
    for name in ("fp16", "powersgd"):
        for ddp_name in ("torch", "ours"):
            for hook_name in ("torch", "ours"):
                module = copy.deepcopy(base)
                ddp = (nn.parallel.DistributedDataParallel(module) if ddp_name == "torch"
                       else DDP(module))
                if name == "fp16":
                    hook = (default_hooks.fp16_compress_hook if hook_name == "torch"
                            else compression.fp16_compress_hook)
                    ddp.register_comm_hook(None, hook)
                else:
                    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
                    ddp.register_comm_hook(
                        *((torch_powersgd.PowerSGDState(None, **options),
                           torch_powersgd.powerSGD_hook) if hook_name == "torch"
                          else (powersgd.PowerSGDState(**options), powersgd.powersgd_hook)))
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
                for x, y in batches:
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), y).backward()
                    opt.step()
                weights[name, ddp_name, hook_name] = torch.cat(
                    [p.detach().reshape(-1) for p in module.parameters()])
    return weights


@pytest.mark.parametrize("world", (2, 4))
def test_hooks_run_on_torchs_ddp_and_ours(world):
    # torch's DDP lays its first step's bucket out in registration order, ours in reverse (the
    # order torch rebuilds it in after that step): gloo then sums each value of 3 or more ranks
    # in another order, which in fp16 rounds differently, by 2^-11 of a gradient (4 ranks: up to
    # 5e-5 of the weights after 5 steps); in fp32, and for 2 ranks, the order does not matter.
    for weights in run_ranks(train_with_hooks_on_rank, world, backend="gloo", timeout=180):
        for name in ("fp16", "powersgd"):
            want = weights[name, "torch", "torch"]
            for key in (("torch", "ours"), ("ours", "torch"), ("ours", "ours")):
                gap = (weights[(name, *key)] - want).abs().max().item()
                same_layout = key[0] == "torch" or world == 2 or name == "powersgd"
                assert gap < (1e-5 if same_layout else 2e-4), (name, key, gap)
        # and compression changed something: fp16 is not the uncompressed run
        assert not torch.equal(weights["fp16", "ours", "ours"], weights["powersgd", "ours", "ours"])


def wrapped_hook_on_rank() -> float:
    """torch's fp16_compress_wrapper leaves the averaged gradients in a buffer of its own: our
    DDP copies the Future's value into the bucket, as torch's does."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = []
    for wrap in (nn.parallel.DistributedDataParallel, DDP):
        model = copy.deepcopy(base)
        ddp = wrap(model)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_wrapper(
            default_hooks.allreduce_hook))
        ddp(x).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return (grads[0] - grads[1]).abs().max().item()


def test_a_hook_whose_result_is_elsewhere_is_copied_into_the_bucket():
    assert max(run_ranks(wrapped_hook_on_rank, 2, backend="gloo")) == 0.0


# --------------------------------------------------------------------------- local SGD
def local_sgd_on_rank(period: int, warmup: int, steps: int = 9) -> float:
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    models = [copy.deepcopy(base) for _ in range(2)]
    ours = local_sgd.LocalSGD(torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.5),
                              period, warmup)
    theirs = PostLocalSGDOptimizer(torch.optim.SGD(models[1].parameters(), lr=0.1, momentum=0.5),
                                   PeriodicModelAverager(period, warmup))
    for s in range(steps):
        g = torch.Generator().manual_seed(10 * s + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g)
        for model, opt in zip(models, (ours, theirs), strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    a, b = ([p.detach() for p in m.parameters()] for m in models)
    return max((p - q).abs().max().item() for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("world", WORLDS)
def test_local_sgd_equals_torchs_post_local_sgd(world):
    for period, warmup in ((1, 0), (3, 0), (4, 3), (2, 5)):
        gaps = run_ranks(local_sgd_on_rank, world, period, warmup, backend="gloo")
        assert max(gaps) == 0.0, (period, warmup, gaps)


def local_sgd_against_torchft_on_rank(every: int, steps: int = 10) -> float:
    """Ours every ``every`` steps (averager warm-up ``every - 1``: after steps every, 2 every,
    ...) against torchft's ``LocalSGD(sync_every=every)``, which averages after the same steps."""
    from torchft.local_sgd import LocalSGD

    from dpcourse.harness.torchft_manager import GlooManager

    rank = dist.get_rank()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    ours_model, theirs_model = copy.deepcopy(base), copy.deepcopy(base)
    ours = local_sgd.LocalSGD(torch.optim.AdamW(ours_model.parameters(), lr=1e-2), every,
                              warmup_steps=every - 1)
    theirs = torch.optim.AdamW(theirs_model.parameters(), lr=1e-2)
    with LocalSGD(GlooManager(), theirs_model, theirs, sync_every=every):
        for s in range(steps):
            g = torch.Generator().manual_seed(10 * s + rank)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g)
            for model, opt in ((ours_model, ours), (theirs_model, theirs)):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    return max((p - q).abs().max().item()
               for p, q in zip(ours_model.parameters(), theirs_model.parameters(), strict=True))


@pytest.mark.parametrize("world", (2, 3))
def test_local_sgd_equals_torchfts(world):
    # torchft averages each parameter (sum, then / N), ours the flat model (/ N, then sum): the
    # same mean rounded in another order, a float32 ulp of the weights
    pytest.importorskip("torchft.local_sgd")
    for every in (1, 3, 5):
        gaps = run_ranks(local_sgd_against_torchft_on_rank, world, every, backend="gloo")
        assert max(gaps) < 1e-6, (every, gaps)


def chapter4_on_rank(k: int, batches: list) -> list[torch.Tensor]:
    """Chapter 4's schedule across ranks: rank r trains on shard r of each batch."""
    from dpcourse.replicas.averaging import batch_shards

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = local_sgd.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), period=k,
                             warmup_steps=k - 1)
    for batch in batches:
        x, y = batch_shards(batch, dist.get_world_size(), None)[dist.get_rank()]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world", (2, 4))
def test_local_sgd_equals_chapter_4s_parameter_averaging(world):
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)) for _ in range(6)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    run = train_parameter_averaging(model, batches, world, nn.functional.mse_loss,
                                    lambda p: torch.optim.SGD(p, lr=0.1), batches[0], k=3)
    got = run_ranks(chapter4_on_rank, world, 3, batches, backend="gloo")[0]
    for p, q in zip(run.model.parameters(), got, strict=True):
        assert torch.allclose(p.detach(), q, atol=1e-6)


# ------------------------------------------------------------------------------ DiLoCo
def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 1))


def make_inner(params):
    return torch.optim.AdamW(params, lr=1e-2)


def make_outer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def worker_batches(world: int, steps: int) -> list:
    """batches[t][w]: replica w's (x, y) at step t, the same in every process."""
    out = []
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        out.append([(torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g))
                    for _ in range(world)])
    return out


def diloco_on_rank(batches: list, sync_every: int, use_torchft: bool) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = make_model()
    inner = make_inner(model.parameters())
    outer = make_outer(model.parameters())
    if use_torchft:
        from torchft.local_sgd import DiLoCo

        from dpcourse.harness.torchft_manager import GlooManager

        with DiLoCo(GlooManager(), [model], inner, outer, sync_every=sync_every):
            for step in batches:
                x, y = step[rank]
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
    else:
        ours = diloco.DiLoCo(model, inner, outer, sync_every)
        for step in batches:
            x, y = step[rank]
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            ours.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", WORLDS)
def test_diloco_equals_the_one_process_reference(world):
    batches = worker_batches(world, 12)
    want = diloco.diloco_reference(make_model(), batches, nn.functional.mse_loss, make_inner,
                                   make_outer, sync_every=3)
    for got in run_ranks(diloco_on_rank, world, batches, 3, False, backend="gloo"):
        for p, q in zip(want.parameters(), got, strict=True):
            assert torch.allclose(p.detach(), q, atol=1e-5, rtol=0), (p - q).abs().max()


@pytest.mark.parametrize("world", (2, 3))
def test_diloco_equals_torchfts(world):
    pytest.importorskip("torchft.local_sgd")
    batches = worker_batches(world, 12)
    ours = run_ranks(diloco_on_rank, world, batches, 4, False, backend="gloo")
    theirs = run_ranks(diloco_on_rank, world, batches, 4, True, backend="gloo")
    for a, b in zip(ours, theirs, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def diloco_with_a_lost_replica_on_rank(batches: list) -> list[torch.Tensor]:
    """Two rounds; in the second, the last rank's round is lost (it sends zeros)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    inner = make_inner(model.parameters())
    ours = diloco.DiLoCo(model, inner, make_outer(model.parameters()), sync_every=1000)
    for t, step in enumerate(batches, start=1):
        inner.zero_grad()
        nn.functional.mse_loss(model(step[rank][0]), step[rank][1]).backward()
        inner.step()
        if t % 3 == 0:
            ours.sync(participating=not (t == 6 and rank == world - 1))
    return [p.detach().clone() for p in model.parameters()]


def sync_with_nobody_on_rank() -> None:
    model = make_model()
    ours = diloco.DiLoCo(model, make_inner(model.parameters()), make_outer(model.parameters()),
                         sync_every=3)
    ours.sync(participating=False)


def test_a_round_nobody_took_part_in_is_an_error_on_every_rank():
    """Not a division by zero that fills every weight with NaN: each rank raises, none waits."""
    with pytest.raises(RankError, match="no rank took part in this round"):
        run_ranks(sync_with_nobody_on_rank, 2, backend="gloo", timeout=60)


def test_a_replica_that_drops_out_is_left_out_of_the_average():
    batches = worker_batches(3, 6)
    got = run_ranks(diloco_with_a_lost_replica_on_rank, 3, batches, backend="gloo")
    # the reference: round 2 averaged over replicas 0 and 1 only
    model = make_model()
    theta = copy.deepcopy(model)
    outer = make_outer(theta.parameters())
    workers = [copy.deepcopy(model) for _ in range(3)]
    inners = [make_inner(w.parameters()) for w in workers]
    for t, step in enumerate(batches, start=1):
        for w, opt, (x, y) in zip(workers, inners, step, strict=True):
            opt.zero_grad()
            nn.functional.mse_loss(w(x), y).backward()
            opt.step()
        if t % 3 == 0:
            kept = workers if t == 3 else workers[:2]
            with torch.no_grad():
                for g, *ps in zip(theta.parameters(), *(w.parameters() for w in kept),
                                  strict=True):
                    g.grad = torch.stack([g - p for p in ps]).mean(0)
                outer.step()
                outer.zero_grad()
                for w in workers:
                    for p, g in zip(w.parameters(), theta.parameters(), strict=True):
                        p.copy_(g)
    for rank_weights in got:
        for p, q in zip(theta.parameters(), rank_weights, strict=True):
            assert torch.allclose(p.detach(), q, atol=1e-5, rtol=0)


# -------------------------------------------------------------------- Streaming DiLoCo
STREAMING_FRAGMENTS = [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]


def fragment_modules(model: nn.Sequential) -> list[nn.Module]:
    """STREAMING_FRAGMENTS as modules (torchft's input): the first layer, the last two."""
    return [model[0], nn.ModuleList([model[2], model[4]])]


def streaming_on_rank(batches: list, options: dict, use_torchft: bool) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = make_model()
    fragments = fragment_modules(model)
    inner = make_inner(model.parameters())
    outers = [make_outer(f.parameters()) for f in fragments]
    sync_every, delay = options["sync_every"], options.get("delay", 0)
    alpha, quantize = options.get("alpha", 0.0), options.get("quantize", False)
    if use_torchft:
        from torchft.local_sgd import DiLoCo

        from dpcourse.harness.torchft_manager import GlooManager

        with DiLoCo(GlooManager(), fragments, inner, outers, sync_every=sync_every,
                    fragment_sync_delay=delay, fragment_update_alpha=alpha):
            for step in batches:
                inner.zero_grad()
                nn.functional.mse_loss(model(step[rank][0]), step[rank][1]).backward()
                inner.step()
    else:
        ours = streaming_diloco.StreamingDiLoCo(fragments, inner, outers, sync_every, delay,
                                                alpha, quantize)
        for step in batches:
            inner.zero_grad()
            nn.functional.mse_loss(model(step[rank][0]), step[rank][1]).backward()
            ours.step()
        ours.close()
    return [p.detach().clone() for p in model.parameters()]


STREAMING_CASES = [dict(sync_every=4), dict(sync_every=6, delay=2, alpha=0.5),
                   dict(sync_every=4, delay=1, quantize=True)]


@pytest.mark.parametrize("world", (2, 4))
def test_streaming_diloco_equals_the_one_process_reference(world):
    batches = worker_batches(world, 12)
    for options in STREAMING_CASES:
        want = streaming_diloco.streaming_reference(
            make_model(), batches, nn.functional.mse_loss, make_inner, make_outer,
            options["sync_every"], STREAMING_FRAGMENTS, options.get("delay", 0),
            options.get("alpha", 0.0), options.get("quantize", False))
        got = run_ranks(streaming_on_rank, world, batches, options, False, backend="gloo")
        for w, weights in zip(want, got, strict=True):
            for p, q in zip(w.parameters(), weights, strict=True):
                assert torch.allclose(p.detach(), q, atol=1e-5, rtol=0), (options, p - q)


def test_streaming_diloco_equals_torchfts():
    pytest.importorskip("torchft.local_sgd")
    batches = worker_batches(2, 12)
    for options in STREAMING_CASES[:2]:  # torchft quantises only with triton, on a GPU
        ours = run_ranks(streaming_on_rank, 2, batches, options, False, backend="gloo")
        theirs = run_ranks(streaming_on_rank, 2, batches, options, True, backend="gloo")
        for a, b in zip(ours, theirs, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), options


def test_one_fragment_without_delay_is_diloco():
    batches = worker_batches(2, 8)
    whole = [[n for n, _ in make_model().named_parameters()]]
    a = streaming_diloco.streaming_reference(make_model(), batches, nn.functional.mse_loss,
                                             make_inner, make_outer, 4, whole)[0]
    b = diloco.diloco_reference(make_model(), batches, nn.functional.mse_loss, make_inner,
                                make_outer, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_streaming_diloco_refuses_a_schedule_it_cannot_keep():
    model = make_model()
    inner = make_inner(model.parameters())
    frags = fragment_modules(model)
    outers = [make_outer(f.parameters()) for f in frags]
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        streaming_diloco.StreamingDiLoCo(frags, inner, outers, sync_every=5)
    with pytest.raises(ValueError, match="delay must be from 0 to"):
        streaming_diloco.StreamingDiLoCo(frags, inner, outers, sync_every=4, delay=2)


# -------------------------------------------------------------------------- quantised
def quantized_on_rank(numel: int) -> torch.Tensor:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank())) * (
        1 + dist.get_rank())
    quantization.quantized_all_reduce(t)
    return t


@pytest.mark.parametrize("world", WORLDS)
def test_quantized_all_reduce_is_the_one_process_arithmetic(world):
    for numel in (1, 300, 2 * 256 * world + 7):
        got = run_ranks(quantized_on_rank, world, numel, backend="gloo")
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) * (1 + r)
                  for r in range(world)]
        want = quantization.quantized_mean(inputs)
        exact = torch.stack(inputs).mean(0)
        for g in got:
            assert torch.equal(g, want)
        # e4m3 keeps 3 mantissa bits: each of the two roundings within 2^-4 of the block's
        # largest value, which here is at most a few times the inputs' scale
        scale = max(t.abs().max().item() for t in inputs)
        assert (want - exact).abs().max().item() <= 2 * 2**-4 * scale


def test_quantize_round_trip_and_bytes():
    blocks = torch.randn(3, quantization.BLOCK)
    blocks[1] = 0.0  # a block of zeros keeps its zeros
    back = quantization.dequantize(*quantization.quantize(blocks))
    assert torch.equal(back[1], blocks[1])
    rel = ((back - blocks).abs() / blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12)).max()
    assert rel <= 2**-4
    assert quantization.quantized_bytes(256 * 4, 4) == 2 * 3 * 4 * (256 + 4) // 4


# ------------------------------------------------------------------------- the model
def test_payloads():
    shapes = [(16, 8), (8,), (4, 3, 3, 3)]
    n = 16 * 8 + 8 + 4 * 27
    assert step_model.payload_bytes("ddp", shapes) == 4 * n
    assert step_model.payload_bytes("fp16", shapes) == 2 * n
    assert step_model.payload_bytes("powersgd", shapes, rank=1) == 4 * (24 + 8 + 31)
    assert step_model.payload_bytes("streaming", shapes, 2) == 2 * 260  # 244 values: 2 blocks
    with pytest.raises(ValueError, match="method must be"):
        step_model.payload_bytes("zip", shapes)


def test_step_time_is_chapter_10s_every_step_and_spread_over_h():
    args = (4, 0.05, 2e6, 1e-4, 1e8)
    ddp = step_model.step_time(*args, hidden_s=2 / 3 * 0.05)
    assert math.isclose(ddp, scaling.step_time(*args, overlap=2 / 3))
    comm = costmodel.all_reduce_time("ring", 4, 2e6, 1e-4, 1e8)
    assert math.isclose(step_model.step_time(*args, every=8), 0.05 + comm / 8)
    assert step_model.step_time(*args, every=8, hidden_s=1.0) == 0.05
    h_c = step_model.reduction_needed(1e9, 8, 1.0, 125e6, budget=0.1)
    assert math.isclose(h_c, 2 * 7 / 8 * 2e9 / 125e6 / 0.1)
    assert step_model.time_to_target(None, 0.1) is None


# ------------------------------------------------------------------------------- GPUs
def gpu_on_rank() -> dict:
    """On the rank's GPU (NCCL with a GPU per rank, gloo where ranks share one): the hooks
    against torch's on CUDA buckets, the quantised all-reduce, a DiLoCo round."""
    from dpcourse import runtime

    device = runtime.device()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=g).to(device) for s in SHAPES]
    out = {"device": device.type}
    got = compression.fp16_compress_hook(None, compression.bucket_of(grads)).wait()
    want = default_hooks.fp16_compress_hook(None, compression.bucket_of(grads)).wait()
    out["fp16"] = (got - want).abs().max().item()
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
    ours, theirs = powersgd.PowerSGDState(**options), torch_powersgd.PowerSGDState(None, **options)
    worst = 0.0
    for _ in range(4):
        a = powersgd.powersgd_hook(ours, compression.bucket_of(grads)).wait()
        b = torch_powersgd.powerSGD_hook(theirs, compression.bucket_of(grads)).wait()
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    out["powersgd"] = worst
    t = torch.randn(1000, generator=g).to(device)
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    quantization.quantized_all_reduce(t)
    out["quantized"] = (t.cpu() - quantization.quantized_mean([e.cpu() for e in everyone])
                        ).abs().max().item()
    model = make_model().to(device)
    inner = make_inner(model.parameters())
    run = diloco.DiLoCo(model, inner, make_outer(model.parameters()), sync_every=2)
    for step in worker_batches(dist.get_world_size(), 4):
        inner.zero_grad()
        x, y = step[rank]
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        run.step()
    out["diloco_on"] = {p.device.type for p in model.parameters()} | {
        s.device.type for s in run.start}
    return out


@pytest.mark.gpu
def test_hooks_quantisation_and_diloco_on_gpus():
    for out in run_ranks(gpu_on_rank, 2, timeout=240):
        assert out["device"] == "cuda"
        assert out["fp16"] == 0.0
        assert out["powersgd"] < 1e-5  # cuBLAS sums in its own order
        assert out["quantized"] < 1e-6  # the same roundings; fp32 sums in another order
        assert out["diloco_on"] == {"cuda"}


# ------------------------------------------------------------------- the bench's plumbing
def test_slow_links_bench_counts_what_each_method_sends():
    """Not its timings: the bytes a rank counts per step, and the model's step for each kind."""
    from dpcourse.harness.bench import slow_links

    n = sum(p.numel() for p in slow_links.make_model().parameters())
    got = run_ranks(slow_links.train_on_rank, 2, "diloco", {"every": 4}, -1.0, 8, 4,
                    backend="gloo")[0]
    assert got["steps"] == 8 and got["steps_to_target"] is None and len(got["curve"]) == 3
    assert got["sent_per_step"] == 2 * (4 * n + 4) / 8  # 2 rounds: the model and the count
    got = run_ranks(slow_links.train_on_rank, 2, "fp16", {}, -1.0, 2, 2, backend="gloo")[0]
    assert got["sent_per_step"] == 2 * n  # N = 2: a ring sends the payload once
    run = {"nodes": 2, "compute": 1e-3, "alpha": 1e-4, "beta": 1.25e6,
           "results": {name: {"overhead": 0.0, "steps": 100, "steps_to_target": 100}
                       for name in slow_links.METHODS}}
    steps = {name: slow_links.modelled(run, name)[0] for name in slow_links.METHODS}
    assert steps["DDP"] > steps["fp16"] > steps["DiLoCo H=8"] > steps["DiLoCo H=32"] > 1e-3
    assert steps["PowerSGD r=1"] < steps["fp16"]
