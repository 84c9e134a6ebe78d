"""Chapter 8's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

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
