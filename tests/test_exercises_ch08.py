"""Chapter 8's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from dpcourse.ddp import ddp
from dpcourse.harness.exercises import ch08, run_check
from dpcourse.practice import checkpoint, lr_schedule, mixed_precision


def expect_fail(label, fn, *phrases):
    result = run_check(label, fn)
    assert not result.passed, result.text()
    for phrase in phrases:
        assert phrase in result.message, (phrase, result.message)


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(ch08, "RANK_TIMEOUT", 30.0)


# ------------------------------------------------------------------------------ ex-8-lr
def test_lr_check():
    assert run_check("ex-8-lr", lambda s, b, n, w: lr_schedule.lr_at(s, b, n, w)).passed
    expect_fail("ex-8-lr", lambda s, b, n, w: b * n, "step 0", "must ramp up")
    expect_fail("ex-8-lr", lambda s, b, n, w: b * n * min(1.0, s / w) if w else b * n,
                "starts from 0")  # fmt: skip
    expect_fail("ex-8-lr", lambda s, b, n, w: lr_schedule.lr_at(s, b, n, w, "sqrt"),
                "square-root rule")  # fmt: skip
    expect_fail("ex-8-lr", lambda s, b, n, w: b + (b * n - b) * s / w if s <= w else b,
                "After the warm-up")  # fmt: skip


# -------------------------------------------------------------------------- ex-8-atomic
def test_atomic_check_passes_the_package():
    assert run_check("ex-8-atomic", checkpoint.atomic_save).passed


def in_place(obj, path):
    torch.save(obj, path)


def temp_in_tmp(obj, path):
    fd, tmp = tempfile.mkstemp()  # in /tmp, not beside the target
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def no_fsync(obj, path):
    tmp = str(path) + ".tmp"
    try:
        torch.save(obj, tmp)
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)


def leaves_temporary(obj, path):
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def test_atomic_check_fails_wrong_saves():
    expect_fail("ex-8-atomic", in_place, "left a corrupt file")
    expect_fail("ex-8-atomic", temp_in_tmp, "not next to the target")
    expect_fail("ex-8-atomic", no_fsync, "os.fsync was never called")
    expect_fail("ex-8-atomic", leaves_temporary, "files were left next to the target")


# ----------------------------------------------------------------------------- ex-8-amp
def _wrong(order):
    def step(model, x, y, optimizer, scaler, max_norm):
        ch08._variant_step(model, x, y, optimizer, scaler, order)

    return step


def test_amp_check(short_timeouts):
    assert run_check("ex-8-amp", mixed_precision.amp_dp_step).passed
    expect_fail("ex-8-amp", _wrong("clip_then_reduce"), "before the all-reduce")
    expect_fail("ex-8-amp", _wrong("clip_scaled"), "clipped before unscaling")
    expect_fail("ex-8-amp", _wrong("no_clip"), "not clipped")
    expect_fail("ex-8-amp", _wrong("unscale_then_reduce"), "overflowed", "only rank 1 saw its inf")


def test_amp_check_catches_missing_averaging(short_timeouts):
    expect_fail("ex-8-amp", _wrong("no_all_reduce"), "step 1", "not averaged over the ranks")


# -------------------------------------------------------------------------- ex-8-syncbn
def global_stats(x):
    from dpcourse.practice import syncbn

    mean, var, _ = syncbn.global_batch_stats(x)
    return mean.double(), var.double()


def exact_global_stats(x):
    count = torch.tensor([float(len(x))], dtype=x.dtype, device=x.device)  # a GPU's, there
    packed = torch.cat([x.sum(0), (x * x).sum(0), count])
    dist.all_reduce(packed)
    c = x.shape[1]
    mean = packed[:c] / packed[-1]
    return mean, packed[c : 2 * c] / packed[-1] - mean**2


def mean_of_means(x):
    m = x.mean(0)
    v = x.var(0, unbiased=False)
    dist.all_reduce(m)
    dist.all_reduce(v)
    return m / dist.get_world_size(), v / dist.get_world_size()


def unbiased(x):
    mean, var = exact_global_stats(x)
    packed = torch.tensor([float(len(x))], dtype=x.dtype, device=x.device)
    dist.all_reduce(packed)
    n = packed.item()
    return mean, var * n / (n - 1)


def local_only(x):
    return x.mean(0), x.var(0, unbiased=False)


def test_syncbn_check(short_timeouts):
    assert run_check("ex-8-syncbn", exact_global_stats).passed
    expect_fail("ex-8-syncbn", mean_of_means, "mean of the ranks' means")
    expect_fail("ex-8-syncbn", unbiased, "unbiased variance")
    expect_fail("ex-8-syncbn", local_only, "this rank's own")


def test_syncbn_check_names_the_variance_mistake(short_timeouts):
    def right_mean_wrong_var(x):
        mean, _ = exact_global_stats(x)
        v = x.var(0, unbiased=False)
        dist.all_reduce(v)
        return mean, v / dist.get_world_size()

    expect_fail("ex-8-syncbn", right_mean_wrong_var, "misses the spread")


# ------------------------------------------------------------------------ ex-8-recovery
def test_recovery_check_reads_the_recorded_log():
    """The answer comes from the recorded elastic run's log (benchmarks/cpu-2core/elastic.json):
    node 1 was killed; node 0 resumed from the checkpoint of step 4."""
    from dpcourse.harness.bench import elastic, recorded

    lines = elastic.recovery_log(recorded("elastic"), "kill")
    assert any("Connection reset by peer" in ln or "closed by peer" in ln for ln in lines)
    assert elastic.resumed_step(lines) == 4
    assert run_check("ex-8-recovery", lambda: {"node": 1, "step": 4}).passed
    expect_fail("ex-8-recovery", lambda: {"node": 0, "step": 4},
                "node 0 printed this log, and it did not fail", "ending in .(i+1)")
    expect_fail("ex-8-recovery", lambda: {"node": 2, "step": 4}, "nodes 0 and 1")
    expect_fail("ex-8-recovery", lambda: {"node": 1, "step": 0}, "did not start over")
    expect_fail("ex-8-recovery", lambda: {"node": 1, "step": 12},
                "step 12 is not where the job resumed", "resumed from ... at step N")
    expect_fail("ex-8-recovery", lambda: {"node": "node 1", "step": 4},
                "the node: expected an int")
    expect_fail("ex-8-recovery", lambda: (1, 4), 'expected a dict {"node": ..., "step": ...}')


def test_recovery_check_names_the_steps_done_twice(monkeypatch):
    """A log that reached step 6 before the failure and resumed at 4: answering 6 is the mistake
    the check explains."""
    from dpcourse.harness.bench import elastic

    lines = ["step     2 | loss 0.7", "step     4 | loss 0.6", "step     6 | loss 0.5",
             "resumed from <dir>/elastic-kill/step-00000004 at step 4", "step     8 | loss 0.4"]
    assert elastic.last_step_before_failure(lines) == 6 and elastic.resumed_step(lines) == 4
    record = {"kill": {"fault": "node 1: 2 processes killed", "output": {"node 0": lines}}}
    monkeypatch.setattr(ch08, "recorded", lambda name: record)
    expect_fail("ex-8-recovery", lambda: {"node": 1, "step": 6},
                "step 6 was the last step logged before the failure",
                "steps 5 to 6 were done twice")
    assert "steps 5 to 6 were done again" in run_check(
        "ex-8-recovery", lambda: {"node": 1, "step": 4}).message


# ------------------------------------------------ the wrong answers students write (issue 43)
def _save(obj, path, order):
    """An atomic save with one of two orders of its file operations wrong (kind 2)."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            if order == "rename, then fsync":
                os.replace(tmp, path)
                os.fsync(f.fileno())
                return
            os.fsync(f.fileno())
        if order == "remove, then rename" and os.path.exists(path):
            os.remove(path)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_with_a_suffix(obj, path):
    """Kind 1: right for a str path, but a pathlib.Path has no + ".tmp"."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_that_swallows_the_failure(obj, path):
    """Kind 2: cleans up after a failed write, and returns as if it had saved."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.fspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        os.remove(tmp)


def test_atomic_check_rejects_what_students_write():
    expect_fail("ex-8-atomic", lambda o, p: _save(o, p, "rename, then fsync"),
                "fsynced the temporary file after renaming it")
    expect_fail("ex-8-atomic", lambda o, p: _save(o, p, "remove, then rename"),
                "removed the old checkpoint before renaming")
    expect_fail("ex-8-atomic", save_with_a_suffix, "saving to a pathlib.Path",
                "unsupported operand")
    expect_fail("ex-8-atomic", save_that_swallows_the_failure, "returned as if the checkpoint",
                "re-raise")


def amp_step_with(device_type=None, dtype=torch.float16, zero_grad=True):
    def step(model, x, y, optimizer, scaler, max_norm):
        with torch.autocast(device_type or x.device.type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x), y)
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        ddp.all_reduce_gradients(model)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()

    return step


@pytest.mark.filterwarnings("ignore:.*CUDA is not available.*")
def test_amp_check_rejects_what_students_write(short_timeouts):
    if not torch.cuda.is_available():  # kind 3: where the batch is not on a GPU, no autocast
        expect_fail("ex-8-amp", amp_step_with(device_type="cuda"), "did not run in float16",
                    "torch.autocast(x.device.type")
    expect_fail("ex-8-amp", amp_step_with(dtype=torch.bfloat16), "ran in bfloat16")
    expect_fail("ex-8-amp", amp_step_with(zero_grad=False), "zero them")


def _stats(x, pack=True, dtype=None, keepdim=False):
    """The reference's one all-reduce of the sums, the squares and the count, in ``dtype``."""
    dtype = dtype or x.dtype
    xs = x.to(dtype)
    count = torch.tensor([float(len(x))], dtype=dtype, device=x.device)
    packed = torch.cat([xs.sum(0), (xs * xs).sum(0), count])
    if pack:
        dist.all_reduce(packed)
    else:  # three all-reduces, one per part
        parts = list(packed.split([x.shape[1], x.shape[1], 1]))
        for part in parts:
            dist.all_reduce(part)
        packed = torch.cat(parts)
    c = x.shape[1]
    mean = packed[:c] / packed[-1]
    var = packed[c : 2 * c] / packed[-1] - mean**2
    return (mean[None], var[None]) if keepdim else (mean, var)


def stats_in_float32(x):
    """Kind 4 (and 1): float32 statistics of a float64 batch; the check used to fail inside
    its own comparison ('Float did not match Double')."""
    return _stats(x, dtype=torch.float32)


def stats_keeping_the_batch_dimension(x):
    """Kind 1 (shape): statistics of shape (1, C)."""
    return _stats(x, keepdim=True)


def stats_centring_x(x):
    """Kind 2: subtracts the mean from the batch in place to get the variance."""
    count = torch.tensor([float(len(x))], dtype=x.dtype, device=x.device)
    packed = torch.cat([x.sum(0), count])
    dist.all_reduce(packed)
    mean = packed[:-1] / packed[-1]
    x.sub_(mean)
    squares = (x * x).sum(0)
    dist.all_reduce(squares)
    return mean, squares / packed[-1]


def stats_in_three_collectives(x):
    """Kind 2: right, with three all-reduces where one carries everything."""
    return _stats(x, pack=False)


def stats_with_a_host_count(x):
    """Kind 3: the count made on the CPU, the sums moved there to join it."""
    count = torch.tensor([float(len(x))], dtype=x.dtype)
    packed = torch.cat([x.sum(0).cpu(), (x * x).sum(0).cpu(), count])
    dist.all_reduce(packed)
    c = x.shape[1]
    mean = packed[:c] / packed[-1]
    return mean, packed[c : 2 * c] / packed[-1] - mean**2


def test_syncbn_check_rejects_what_students_write(short_timeouts, rejects):
    expect_fail("ex-8-syncbn", stats_in_float32, "torch.float32", "in x's dtype torch.float64")
    expect_fail("ex-8-syncbn", stats_keeping_the_batch_dimension, "shape (1, 3)",
                "expected shape (3,)")
    expect_fail("ex-8-syncbn", stats_centring_x, "changed its argument x")
    expect_fail("ex-8-syncbn", stats_in_three_collectives, "called 3 collectives",
                "one is enough")
    rejects("ex-8-syncbn", stats_with_a_host_count, "the mean is on the CPU")
