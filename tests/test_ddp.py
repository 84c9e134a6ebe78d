"""DDP from scratch (dpcourse.ddp.ddp) against single-process training and torch's DDP.

Each world size is one launch: the rank function trains every variant and returns what failed,
so that a failure names the variant and the parameter instead of hiding in a rank. These runs use
CPU tensors, so they ask for gloo (on a multi-GPU machine "auto" would pick NCCL); the GPU test
at the end runs on the ranks' devices.

Tolerance: float32 with rtol=1e-5, atol=1e-6. The data-parallel gradient is the mean of the
ranks' shard means, summed in another order than the single process's mean over the whole
batch (and gloo's ring sums chunks in yet another order), so results agree to a few float32
roundings (unit roundoff 6e-8) per step, compounded over the steps: we see differences of a
few 1e-8. A wrong gradient (a sum instead of a mean, one rank's gradient, a missing bucket)
moves the parameters by 1e-3 or more; each run checks that training without synchronisation
fails the comparison by more than 100 times the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse import runtime
from dpcourse.ddp import ddp, sampler, timeline
from dpcourse.ddp.buckets import MB, bucket_assignment
from dpcourse.ddp.timeline import timed_backward
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device import data, models

STEPS, LR, BATCH = 6, 0.1, 24  # BATCH: the global batch, divisible by 2 and 4 ranks
RTOL, ATOL = 1e-5, 1e-6
B = 1 / MB  # one byte, in the MiB that bucket_cap_mb counts


Tricky, Branchy = models.Tricky, models.Branchy  # shared with chapter 7


def uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # on 2 ranks, step 1 uses it nowhere


# Bucket counts of the MLP (5 -> 32 -> 32 -> 2; gradients of 640, 128, 4096, 128, 256 and 8
# bytes in registration order) and of Tricky, and the buckets they should give.
MLP_CAPS = {
    25.0: [["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"]],
    # 8 + 256 + 128 + 4096 = 4488 bytes, under the cap; fc1.bias takes the bucket past it
    4500 * B: [["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight", "fc1.bias"], ["fc1.weight"]],
    # fc2.weight (4096 bytes) is larger than the cap: it closes the bucket it opens
    300 * B: [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight"], ["fc1.bias", "fc1.weight"]],
}
# Tricky's trainable gradients: inp.weight 160 B, inp.bias 32, mid.weight 256, out 64 and 8
TRICKY_CAPS = {
    25.0: [["out.bias", "out.weight", "mid.weight", "inp.bias", "inp.weight"]],
    0.0: [["out.bias"], ["out.weight"], ["mid.weight"], ["inp.bias"], ["inp.weight"]],
    100 * B: [["out.bias", "out.weight", "mid.weight"], ["inp.bias", "inp.weight"]],
}


def batches(world: int, rank: int, per_rank_micro: int = 1):
    """STEPS global batches of BATCH * per_rank_micro samples: (whole batch, this rank's shard)."""
    n = BATCH * per_rank_micro
    x, y = data.random_regression(num_samples=STEPS * n).tensors
    for s in range(STEPS):
        xs, ys = x[s * n : (s + 1) * n], y[s * n : (s + 1) * n]
        yield (xs, ys), (xs.chunk(world)[rank], ys.chunk(world)[rank])


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(what: str, got: dict, want: dict, failures: list, rtol=RTOL, atol=ATOL) -> float:
    worst = 0.0
    for name in want:
        diff = (got[name] - want[name]).abs().max().item() if want[name].numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(got[name], want[name], rtol=rtol, atol=atol):
            failures.append(
                f"rank {dist.get_rank()} of {dist.get_world_size()}: {what}: {name} "
                f"differs from the reference by {diff:.3g}"
            )
    return worst


def train_plain(
    make, kind: str, options=None, set_to_none=True, by_hand=True
) -> tuple[dict, nn.Module]:
    """STEPS SGD steps on this rank's shards; the model was seeded differently on every rank.
    With ``set_to_none=False`` DDP's gradients stay views of its buckets between steps, and
    autograd accumulates straight into them. ``by_hand=False``: a torch-style loop, with no
    finish_gradient_synchronization() between backward and step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    model = make(rank)
    wrapped, finish = ddp.wrap(kind, model, **(options or {}))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for _, (x, y) in batches(world, rank):
        loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        if by_hand:
            finish()
        opt.step()
    return params_of(model), wrapped


def reference_plain(make) -> dict:
    torch.manual_seed(100)  # rank 0's seed: DDP starts every rank from rank 0's model
    model = make(0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for (x, y), _ in batches(dist.get_world_size(), 0):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return params_of(model)


def bucket_names(wrapped: ddp.DDP) -> list[list[str]]:
    names = {p: n for n, p in wrapped.module.named_parameters()}
    return [[names[p] for p in b.params] for b in wrapped.buckets]


def check_plain_models(failures: list, worst: dict) -> None:
    models_and_caps = {
        "MLP": (lambda rank: models.MLP(), MLP_CAPS),
        "Tricky": (lambda rank: Tricky(scale=1.0 + rank), TRICKY_CAPS),
    }
    for model_name, (make, caps) in models_and_caps.items():
        want = reference_plain(make)
        unsynced, _ = train_plain(make, "none")
        if dist.get_rank() > 0:  # rank 0 starts from the reference's weights; the others do not
            lost = []
            compare("no synchronisation", unsynced, want, lost)
            diff = max((unsynced[n] - want[n]).abs().max().item() for n in want)
            if diff < 100 * ATOL:
                failures.append(
                    f"{model_name}: training without synchronisation is only {diff:.2g} away "
                    "from the reference: the comparison cannot fail"
                )
        runs = [("step 2", {}), ("step 3", {}), ("torch DDP", {})]
        runs += [("DDP", dict(bucket_cap_mb=c, overlap=o)) for c in caps for o in (True, False)]
        got, wrapped = train_plain(make, "DDP", dict(bucket_cap_mb=min(caps)), set_to_none=False)
        what = f"{model_name}, DDP, zero_grad(set_to_none=False)"
        worst[what] = compare(what, got, want, failures)
        views = {b.buffer.untyped_storage().data_ptr() for b in wrapped.buckets}
        if any(p.grad.untyped_storage().data_ptr() not in views for p in wrapped.reducer.where):
            failures.append(f"{what}: a gradient is not a view of its bucket")
        for kind, options in runs:
            cap = options.get("bucket_cap_mb")
            what = f"{model_name}, {kind}" + (
                f", cap {cap * MB:g} B, overlap={options['overlap']}" if kind == "DDP" else ""
            )
            got, wrapped = train_plain(make, kind, options)
            worst[what] = compare(what, got, want, failures)
            if kind == "DDP" and bucket_names(wrapped) != caps[cap]:
                failures.append(f"{what}: buckets {bucket_names(wrapped)}, expected {caps[cap]}")
            if kind == "DDP":
                module = wrapped.module
                for name, buf in module.named_buffers():  # rank 0's buffer everywhere
                    if not torch.equal(buf, make(0).get_buffer(name)):
                        failures.append(f"{what}: buffer {name} is {buf.tolist()}, not rank 0's")
                if list(module.state_dict()) != list(make(0).state_dict()):
                    failures.append(f"{what}: the wrapped module's state_dict keys changed")
                if [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]:
                    failures.append(f"{what}: a trainable parameter has no gradient")
                if module.frozen.weight.grad is not None if model_name == "Tricky" else False:
                    failures.append(f"{what}: the frozen layer got a gradient")


def check_unused_parameters(failures: list, worst: dict) -> None:
    """Branchy uses `extra` on some ranks in some steps: every rank must agree and nobody hang.
    (PerParameterDDP, step 3, is left out on purpose: its all-reduces start in the order the
    gradients arrive, which differs between ranks whose graphs differ. Fixing the launch order
    is one of the things buckets do.)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data.random_regression(num_samples=STEPS * BATCH).tensors
    torch.manual_seed(7)
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for s in range(STEPS):  # the mean of the ranks' losses, each with its own branch
        xs = x[s * BATCH : (s + 1) * BATCH].chunk(world)
        ys = y[s * BATCH : (s + 1) * BATCH].chunk(world)
        loss = sum(F.mse_loss(ref(xs[r], uses_extra(s, r)), ys[r]) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = params_of(ref)
    runs = [("step 2", {}), ("torch DDP", {"find_unused_parameters": True})]
    runs += [("DDP", dict(bucket_cap_mb=c, overlap=o)) for c in (0.0, 25.0) for o in (True, False)]
    for kind, options in runs:
        torch.manual_seed(7)
        model = Branchy()
        wrapped, finish = ddp.wrap(kind, model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(STEPS):
            xs = x[s * BATCH : (s + 1) * BATCH].chunk(world)[rank]
            ys = y[s * BATCH : (s + 1) * BATCH].chunk(world)[rank]
            opt.zero_grad()
            F.mse_loss(wrapped(xs, uses_extra(s, rank)), ys).backward()
            finish()
            opt.step()
        what = f"unused parameters, {kind}" + (
            f", cap {options['bucket_cap_mb']}, overlap={options['overlap']}"
            if kind == "DDP"
            else ""
        )
        worst[what] = compare(what, params_of(model), want, failures)


def check_no_sync(failures: list, worst: dict) -> None:
    """Three micro-batches per step, the first two inside no_sync(): equals one large batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = 3
    torch.manual_seed(3)
    ref = models.MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for (x, y), _ in batches(world, rank, micro):
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    want = params_of(ref)
    for kind, overlap in [("DDP", True), ("DDP", False), ("torch DDP", True)]:
        torch.manual_seed(3)
        model = models.MLP()
        options = dict(bucket_cap_mb=300 * B, overlap=overlap) if kind == "DDP" else {}
        wrapped, finish = ddp.wrap(kind, model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _, (x, y) in batches(world, rank, micro):
            opt.zero_grad()
            for k, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                ctx = wrapped.no_sync() if k < micro - 1 else contextlib.nullcontext()
                with ctx:
                    (F.mse_loss(wrapped(xm), ym) / micro).backward()
            finish()
            opt.step()
        what = f"no_sync accumulation, {kind}, overlap={overlap}"
        worst[what] = compare(what, params_of(model), want, failures)


def check_buffers_like_torch(failures: list, worst: dict) -> None:
    """ConvNetBN in training mode: with broadcast_buffers, parameters and BatchNorm's running
    statistics on every rank equal torch's DDP's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data.random_images(num_samples=64).tensors
    results = {}
    for kind in ("DDP", "torch DDP"):
        torch.manual_seed(11 + rank)
        model = models.ConvNetBN()
        wrapped, finish = ddp.wrap(kind, model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(3):
            xs = x[s * 16 : (s + 1) * 16].chunk(world)[rank]
            ys = y[s * 16 : (s + 1) * 16].chunk(world)[rank]
            opt.zero_grad()
            F.cross_entropy(wrapped(xs), ys).backward()
            finish()
            opt.step()
        results[kind] = {**params_of(model), **{n: b.clone() for n, b in model.named_buffers()}}
    worst["ConvNetBN, DDP vs torch DDP"] = compare(
        "ConvNetBN parameters and buffers, DDP vs torch DDP",
        results["DDP"],
        {k: v.float() if v.is_floating_point() else v for k, v in results["torch DDP"].items()},
        failures,
    )


def check_torch_style_loop(failures: list, worst: dict) -> None:
    """`loss.backward(); opt.step()` with nothing between, as a torch DDP user writes it: the
    end of backward has synchronised the gradients, overlapped or not."""
    want = reference_plain(lambda rank: models.MLP())
    for overlap in (True, False):
        got, _ = train_plain(lambda rank: models.MLP(), "DDP", dict(overlap=overlap),
                             by_hand=False)
        worst[f"torch-style loop, overlap={overlap}"] = compare(
            f"DDP in a torch-style loop, overlap={overlap}", got, want, failures)


def equivalence_on_rank() -> tuple[list[str], dict]:
    failures: list[str] = []
    worst: dict[str, float] = {}
    check_plain_models(failures, worst)
    check_unused_parameters(failures, worst)
    check_no_sync(failures, worst)
    check_buffers_like_torch(failures, worst)
    check_torch_style_loop(failures, worst)
    return failures, worst


@pytest.mark.parametrize("world", [2, 4])
def test_every_variant_equals_single_process_and_torch_ddp(world):
    results = run_ranks(equivalence_on_rank, world, backend="gloo", timeout=240)
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures[:20])
    worst = max(max(w.values()) for _, w in results)
    assert worst < ATOL  # what the docstring says we see


def misuse_on_rank() -> dict[str, str]:
    """Every misuse the same way on every rank, so that nobody waits for the others."""
    rank = dist.get_rank()
    found = {}

    def message(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            return str(exc)
        return "no error"

    found["different models"] = message(lambda: ddp.DDP(nn.Linear(4, 4 + rank)))
    frozen = nn.Linear(4, 4)
    frozen.bias.requires_grad_(rank == 0)  # the same shapes, but not the same trainable ones
    found["different frozen"] = message(lambda: ddp.DDP(frozen))
    found["different buffers"] = message(lambda: ddp.DDP(nn.BatchNorm1d(3 + rank, affine=False)))
    wrapped = ddp.DDP(models.MLP(), bucket_cap_mb=0)
    x, y = torch.randn(4, 5), torch.randn(4, 2)
    with wrapped.no_sync():
        F.mse_loss(wrapped(x), y).backward()
        found["finish inside no_sync"] = message(wrapped.finish_gradient_synchronization)
    # the end of backward synchronises (as torch's DDP): a forward may follow at once, and a
    # second finish_gradient_synchronization() changes nothing
    F.mse_loss(wrapped(x), y).backward()
    grads = [p.grad.clone() for p in wrapped.parameters()]
    found["finish again"] = message(wrapped.finish_gradient_synchronization)
    found["finish again keeps"] = all(
        torch.equal(g, p.grad) for g, p in zip(grads, wrapped.parameters(), strict=True))
    found["forward after backward"] = message(lambda: wrapped(x))
    # torch's DDP takes None for its default cap; so does ours
    sizes = [[p.numel() for p in b.params] for b in ddp.DDP(models.MLP()).reducer.buckets]
    found["cap None"] = sizes == [
        [p.numel() for p in b.params]
        for b in ddp.DDP(models.MLP(), bucket_cap_mb=None).reducer.buckets
    ]
    return found


def test_misuse_gives_clear_errors():
    found = run_ranks(misuse_on_rank, 2, backend="gloo", timeout=120)
    for f in found:
        for case in ("different models", "different frozen", "different buffers"):
            assert "the ranks wrap different models" in f[case], case
        assert "inside ddp.no_sync()" in f["finish inside no_sync"]
        assert f["forward after backward"] == f["finish again"] == "no error"
        assert f["finish again keeps"] is True
        assert f["cap None"] is True


def test_errors_without_a_process_group_or_on_several_devices():
    assert not dist.is_initialized()
    for make in (
        lambda: ddp.DDP(models.MLP()),
        lambda: ddp.PerParameterDDP(models.MLP()),
        lambda: ddp.broadcast_parameters(models.MLP()),
        lambda: ddp.all_reduce_gradients(models.MLP()),
    ):
        with pytest.raises(RuntimeError, match="needs a process group.*run_ranks"):
            make()
    model = models.MLP()
    model.fc3.to("meta")
    with pytest.raises(ValueError, match="one device.*fc3.weight on meta.*module.to"):
        ddp.DDP(model)
    with pytest.raises(ValueError, match="bucket_cap_mb must be 0 or more"):
        ddp.DDP(models.MLP(), bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number of MiB .or None: 25."):
        ddp.DDP(models.MLP(), bucket_cap_mb="25")
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        ddp.DDP(lambda x: x)


def test_bucket_assignment():
    assert bucket_assignment([], 10) == []
    assert bucket_assignment([4, 4, 4], 100) == [[2, 1, 0]]
    assert bucket_assignment([4, 4, 4], 0) == [[2], [1], [0]]
    assert bucket_assignment([4, 4, 4], 8) == [[2, 1], [0]]
    # the parameter that takes a bucket past the cap is its last, as in torch
    assert bucket_assignment([4, 4, 4], 6) == [[2, 1], [0]]
    assert bucket_assignment([1, 50, 1, 1], 8) == [[3, 2, 1], [0]]
    with pytest.raises(ValueError, match="0 or more bytes"):
        bucket_assignment([1], -1)


def _torch_assignment(param_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """torch's DDP's own assignment (its reducer's C++), for float32 gradients of these sizes,
    given in reverse registration order as DDP gives them, with one cap for every bucket."""
    n = len(param_bytes)
    tensors = [torch.empty(b // 4) for b in reversed(param_bytes)]
    got, _ = dist._compute_bucket_assignment_by_size(tensors, [cap_bytes])
    return [[n - 1 - i for i in bucket] for bucket in got]


@pytest.mark.parametrize("seed", range(40))
def test_bucket_assignment_is_torchs(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (1,), generator=g))
    param_bytes = (4 * torch.randint(1, 200, (n,), generator=g)).tolist()
    for cap in (4, 100, 400, int(torch.randint(1, 2000, (1,), generator=g)), 10**6):
        assert bucket_assignment(param_bytes, cap) == _torch_assignment(param_bytes, cap), cap
    # and on the course's Transformer, at the caps chapter 7 uses
    sizes = [4 * p.numel() for p in models.TinyTransformer().parameters()]
    for cap_mb in (0.005, 0.02, 0.1, 0.25, 0.4, 1):
        cap = int(cap_mb * MB)
        assert bucket_assignment(sizes, cap) == _torch_assignment(sizes, cap), cap_mb


def timeline_on_rank() -> list:
    torch.manual_seed(0)
    out = []
    for overlap in (True, False):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        wrapped = ddp.DDP(model, bucket_cap_mb=64 * 65 * 4 * B, overlap=overlap)  # one per layer
        x = torch.randn(32, 64)
        timeline = timed_backward(wrapped, wrapped(x).square().mean())
        out.append((overlap, len(wrapped.buckets), timeline))
    return out


def test_timeline_shows_launches_during_backward_only_with_overlap():
    for overlap, n, t in run_ranks(timeline_on_rank, 2, backend="gloo", timeout=120)[0]:
        assert [b.index for b in t.buckets] == list(range(n)) and n == 6
        for b in t.buckets:
            assert 0 <= b.launched_s <= b.completed_s <= t.finished_s + 1e-3
            # the hook runs inside backward, so with overlap every launch precedes its end
            assert (b.launched_s < t.backward_s) == overlap
        assert t.buckets[0].nbytes == 64 * 65 * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 5, 10, 11])
def test_epoch_indices_equal_distributed_sampler(world, n):
    from torch.utils.data import DistributedSampler

    for epoch in (0, 1, 3):
        for shuffle in (True, False):
            for rank in range(world):
                torch_sampler = DistributedSampler(
                    range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5
                )
                torch_sampler.set_epoch(epoch)
                ours = sampler.epoch_indices(n, world, rank, epoch, seed=5, shuffle=shuffle)
                assert ours == list(torch_sampler)


def gpu_on_rank() -> tuple[str, float, int]:
    """DDP and torch's DDP on this rank's GPU (gloo with CUDA tensors on one GPU, NCCL on
    several), trained alike; and a timeline of one step."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), runtime.device()
    results = {}
    for kind in ("DDP", "torch DDP"):
        torch.manual_seed(0)
        model = models.MLP().to(device)
        if kind == "DDP":
            options = dict(bucket_cap_mb=300 * B)
        else:
            options = dict(device_ids=[device.index] if device.type == "cuda" else None)
        wrapped, finish = ddp.wrap(kind, model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _, (x, y) in batches(world, rank):
            opt.zero_grad()
            F.mse_loss(wrapped(x.to(device)), y.to(device)).backward()
            finish()
            opt.step()
        results[kind] = {n: p.cpu() for n, p in params_of(model).items()}
    diff = max(
        (results["DDP"][n] - results["torch DDP"][n]).abs().max().item() for n in results["DDP"]
    )
    x = torch.randn(8, 5, device=device)
    timeline = timed_backward(
        wrapped_ddp := ddp.DDP(models.MLP().to(device), bucket_cap_mb=300 * B),
        wrapped_ddp(x).square().mean()
    )
    return device.type, diff, len(timeline.buckets)


@pytest.mark.gpu
def test_ddp_on_gpu_equals_torch_ddp():
    for device_type, diff, buckets in run_ranks(gpu_on_rank, 2, timeout=240):
        assert device_type == "cuda"
        assert diff < 1e-5  # GPUs sum in their own orders: a little above the CPU's roundings
        # 300-byte buckets of the MLP's 6 gradients (8, 256, 128 | 4096 | 128, 640 bytes)
        assert buckets == len(bucket_assignment(
            [p.numel() * 4 for p in models.MLP().parameters()], 300)) == 3


def test_bench_ddp_reports_every_variant(capsys):
    """The benchmark's plumbing (not its timings): every variant, a ratio to torch DDP."""
    from dpcourse.harness.bench import ddp as bench

    result = bench.bench_ddp(2, repeats=2, warmup=0, batch=4, model_names=["transformer"])
    assert [r["variant"] for r in result["rows"]] == list(bench.DEFAULT_VARIANTS)
    assert all(r["median_s"] > 0 for r in result["rows"])
    assert result["rows"][0]["over_torch_ddp"] == 1.0
    bench.report(result)
    assert "DDP, 25 MiB buckets, overlapped" in capsys.readouterr().out


def test_wrap_names_its_variants():
    model = nn.Linear(2, 2)
    wrapped, finish = ddp.wrap("none", model)
    assert wrapped is model and finish() is None
    with pytest.raises(ValueError, match="the variants are"):
        ddp.wrap("step 5", model)


def test_paired_median_and_recorded_timelines():
    from dataclasses import asdict

    from dpcourse.harness.bench import ddp as ddp_bench

    times = {"a": [1.0, 5.0, 2.0], "b": [0.5, 4.0, 1.9]}  # each round's difference: .5, 1, .1
    assert ddp_bench.paired_median(times, "a", "b") == pytest.approx(0.5)
    t = timeline.StepTimeline(0.03, 0.07, [timeline.BucketTiming(0, 64, 0.01, 0.05)])
    assert timeline.timelines_from_json({"overlap=True": asdict(t)}) == {"overlap=True": t}


def _torch_arguments_on_rank() -> dict:
    """torch's DistributedDataParallel arguments, given to the course's DDP."""
    out = {}

    def error(fn):
        try:
            fn()
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def mlp() -> nn.Module:  # on the rank's device: NCCL takes no host tensors
        return models.MLP().to(runtime.device())

    torch.manual_seed(dist.get_rank())  # different weights on each rank
    # torch's positional order: device_ids, output_device, dim, broadcast_buffers, init_sync,
    # process_group, bucket_cap_mb, find_unused_parameters, check_reduction,
    # gradient_as_bucket_view, static_graph
    wrapped = ddp.DDP(mlp(), None, None, 0, True, True, None, 0.001, True, False, True,
                      True)
    out["synced"] = [p.detach().clone() for p in wrapped.parameters()]
    out["buckets"] = len(wrapped.buckets)
    torch.manual_seed(dist.get_rank())
    kept = ddp.DDP(mlp(), init_sync=False)
    out["not_synced"] = [p.detach().clone() for p in kept.parameters()]
    out["default_group"] = error(lambda: ddp.DDP(mlp(), process_group=dist.group.WORLD))
    out["dim"] = error(lambda: ddp.DDP(mlp(), dim=1))
    out["device_ids"] = error(lambda: ddp.DDP(mlp(), device_ids=[0, 1]))
    out["mixed_precision"] = error(lambda: ddp.DDP(mlp(), mixed_precision=object()))
    out["typo"] = error(lambda: ddp.DDP(mlp(), bucket_cap=25))
    group = dist.new_group([0, 1])
    out["group"] = error(lambda: ddp.DDP(mlp(), process_group=group))
    return out


def test_torch_arguments_are_accepted_where_they_mean_something():
    r0, r1 = run_ranks(_torch_arguments_on_rank, 2, timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(r0["synced"], r1["synced"], strict=True))
    assert r0["buckets"] > 1  # bucket_cap_mb=0.001 came through, in its place
    assert not all(torch.equal(a, b)
                   for a, b in zip(r0["not_synced"], r1["not_synced"], strict=True))
    assert r0["default_group"] is None
    assert r0["dim"].startswith("ValueError: dim=1")
    assert r0["device_ids"].startswith("ValueError: device_ids=[0, 1]")
    assert r0["mixed_precision"].startswith("TypeError: DDP() does not take mixed_precision=")
    assert "torch.autocast" in r0["mixed_precision"]
    assert r0["typo"].startswith("TypeError: DDP() does not take bucket_cap=")
    assert r0["group"].startswith("ValueError: process_group")


def _hook_and_unused_on_rank() -> dict:
    """torch's DDP and ours, both with find_unused_parameters=True and a communication hook
    (chapter 12's layer on top of chapter 7's KeepUnused): Branchy's `extra` used on no rank."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    base = Branchy()
    x, y = torch.randn(6, 5), torch.randn(6, 2)
    grads = {}
    for name, wrap in (("torch", nn.parallel.DistributedDataParallel), ("ours", ddp.DDP)):
        model = copy.deepcopy(base)
        wrapped = wrap(model, find_unused_parameters=True)
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        model.zero_grad()  # None: what a parameter no rank used keeps
        F.mse_loss(wrapped(x * (dist.get_rank() + 1), use_extra=False), y).backward()
        if name == "ours":
            wrapped.finish_gradient_synchronization()
        grads[name] = {n: None if p.grad is None else p.grad.clone()
                       for n, p in model.named_parameters()}
    return grads


def test_a_comm_hook_keeps_unused_parameters_as_torch_does():
    for grads in run_ranks(_hook_and_unused_on_rank, 2, backend="gloo", timeout=120):
        assert grads["torch"].keys() == grads["ours"].keys()
        for name, want in grads["torch"].items():
            got = grads["ours"][name]
            if want is None:
                assert got is None, name  # `extra`: no rank used it
            else:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=name)
