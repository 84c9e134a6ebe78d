"""dpcourse.practice.checkpoint: atomic files, crash safety, and resuming on the exact same
trajectory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from dpcourse.harness.launch import RankError, run_ranks
from dpcourse.practice import checkpoint as C

TIMEOUT = 120.0


# ------------------------------------------------------------------------------ atomic files
def test_atomic_save_roundtrip_and_no_temporary_left(tmp_path):
    obj = {"w": torch.arange(10.0), "step": 3}
    C.atomic_save(obj, tmp_path / "a.pt")
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(got["w"], obj["w"]) and got["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


def test_an_exception_during_the_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "a.pt"
    C.atomic_save({"version": 1}, target)

    def half_then_fail(f):
        f.write(b"\x80\x02 half a pickle")
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        C.atomic_write(target, half_then_fail)
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # the temporary file is gone


def test_a_plain_torch_save_interrupted_leaves_a_corrupt_file(tmp_path):
    """The reason for all this: writing in place and failing half-way destroys the old file."""
    target = tmp_path / "a.pt"
    torch.save({"version": 1}, target)
    with pytest.raises(OSError), open(target, "wb") as f:
        f.write(b"\x80\x02 half a pickle")
        raise OSError("disk full (simulated)")
    with pytest.raises(Exception):  # noqa: B017 - any unpickling error
        torch.load(target, weights_only=True)


# ------------------------------------------------------------------------ checkpoints, 1 rank
def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, n):
    for _ in range(n):
        x = torch.randn(16, 4)  # drawn from the global generator: the RNG state matters
        loss = torch.nn.functional.dropout(model(x), 0.3).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    model, opt = _model_and_optimizer()
    assert C.latest_checkpoint(tmp_path / "nothing") is None
    assert C.load_checkpoint(tmp_path / "nothing", model, opt) is None


def test_manifest_keeps_the_newest_checkpoints(tmp_path):
    model, opt = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        C.save_checkpoint(tmp_path, step, model, opt, progress={"epoch": step}, keep=2)
    manifest = json.loads((tmp_path / C.MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["path"] == "step-00000004"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert C.load_checkpoint(tmp_path, model, opt)["progress"] == {"epoch": 4}
    with pytest.raises(ValueError, match="keep must be at least 1"):
        C.save_checkpoint(tmp_path, 5, model, opt, keep=0)


def test_resume_in_one_process_is_exact_and_needs_the_rng(tmp_path):
    model, opt = _model_and_optimizer()
    _steps(model, opt, 3)
    C.save_checkpoint(tmp_path, 3, model, opt)
    _steps(model, opt, 4)
    want = [p.detach().clone() for p in model.parameters()]

    for restore_rng in (True, False):
        torch.manual_seed(1234)  # a different generator state, as in a new process
        fresh, fresh_opt = _model_and_optimizer(seed=99)
        info = C.load_checkpoint(tmp_path, fresh, fresh_opt, restore_rng=restore_rng)
        assert info["step"] == 3
        _steps(fresh, fresh_opt, 4)
        same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), want, strict=True))
        assert same == restore_rng  # without the generators the trajectory differs


def test_rng_state_roundtrip_covers_python_and_numpy(tmp_path):
    import random

    import numpy as np

    state = C.capture_rng_state()
    C.atomic_save(state, tmp_path / "rng.pt")
    a = (torch.rand(3), random.random(), np.random.rand(3))
    C.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    b = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])


# --------------------------------------------------------------------- killed during a write
WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from dpcourse.practice import checkpoint as C
    directory, mode = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(1000, 1000)          # 4 MB of parameters: a write takes a while
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.init.constant_(model.weight, 1.0)
    C.save_checkpoint(directory, 1, model, opt)
    print("saved step 1", flush=True)
    if mode == "die-mid-write":
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 the first bytes of a zip")  # a partial file, then death
            f.flush()
            os._exit(3)
        C.torch.save = dying_save
        torch.nn.init.constant_(model.weight, 2.0)
        C.save_checkpoint(directory, 2, model, opt)
    else:  # save over and over until killed from outside
        step = 2
        while True:
            torch.nn.init.constant_(model.weight, float(step))
            C.save_checkpoint(directory, step, model, opt)
            step += 1
    """
)


def _latest_weight_value(directory):
    model = torch.nn.Linear(1000, 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    info = C.load_checkpoint(directory, model, opt)
    value = model.weight[0, 0].item()
    assert torch.equal(model.weight, torch.full_like(model.weight, value))  # not a mix
    return info["step"], value


def test_a_writer_dying_mid_write_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path), "die-mid-write"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 3, proc.stderr
    assert C.latest_checkpoint(tmp_path)["step"] == 1
    assert _latest_weight_value(tmp_path) == (1, 1.0)
    # the dead writer left a temporary file, never a file under the real name
    assert not (tmp_path / "step-00000002" / C.CHECKPOINT_FILE).exists()
    assert list((tmp_path / "step-00000002").glob(".checkpoint.pt.*.tmp"))


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    # Three writers side by side (each start imports torch: a few seconds), each killed at its
    # own moment after its first checkpoint.
    delays = (0.3, 0.7, 1.1)
    procs = {delay: subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / f"run-{delay}"), "loop"],
        stdout=subprocess.PIPE, text=True) for delay in delays}  # fmt: skip
    try:
        ready = {}
        for delay, proc in procs.items():
            assert proc.stdout.readline().strip() == "saved step 1"
            ready[delay] = time.monotonic()
        for delay in sorted(delays, key=lambda d: ready[d] + d):
            time.sleep(max(0.0, ready[delay] + delay - time.monotonic()))
            procs[delay].send_signal(signal.SIGKILL)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    for delay in delays:
        step, value = _latest_weight_value(tmp_path / f"run-{delay}")
        assert value == float(step) and step >= 1


# ------------------------------------------------------------------------ 2 ranks, exact resume
def _train_on_ranks(directory, total_steps, save_at, resume, restore_rng=True, sharded=False):
    """Runs on every rank: a small data-parallel loop with dropout and a DistributedSampler."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from dpcourse import runtime
    from dpcourse.one_device.data import random_regression
    from dpcourse.practice import checkpoint as C

    rank, world = dist.get_rank(), dist.get_world_size()
    device = runtime.device()  # a GPU where there is one: dropout then draws from its generator
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    ).to(device)
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    params = list(model.parameters())
    if sharded:  # a miniature ZeRO-1: rank r keeps Adam state for params r, r+N, ...
        mine = params[rank::world]
        opt = torch.optim.AdamW(mine, lr=1e-2)
    else:
        opt = torch.optim.AdamW(params, lr=1e-2)
    data = random_regression(96, seed=1)
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    # Each new DataLoader iterator draws a seed from its generator; a private one keeps those
    # draws out of the global generator, whose state the checkpoint restores.
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
    step = 0
    if resume:
        info = C.load_checkpoint(directory, model, opt, restore_rng=restore_rng)
        step = info["step"]
    while step < total_steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue  # the batches this epoch had seen before the checkpoint
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            model.zero_grad()  # not opt.zero_grad(): a sharded optimizer holds only some params
            loss.backward()
            for p in params:
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            if sharded:
                for i_p, p in enumerate(params):
                    dist.broadcast(p.data, src=i_p % world)
            step += 1
            if step == save_at:
                C.save_checkpoint(
                    directory,
                    step,
                    model,
                    opt,
                    progress={"epoch": epoch},
                    sharded_optimizer=sharded,
                )
            if step == total_steps:
                break
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_resume_on_new_ranks_is_exact(tmp_path, sharded):
    """k steps, checkpoint, m more; vs k steps, stop, new processes load and take m steps."""
    k, total = 7, 20  # 96 samples / 2 ranks / batch 8 = 6 steps per epoch: resume mid-epoch
    straight = run_ranks(
        _train_on_ranks, 2, tmp_path / "a", total, k, False, sharded=sharded, timeout=TIMEOUT
    )
    run_ranks(_train_on_ranks, 2, tmp_path / "b", k, k, False, sharded=sharded, timeout=TIMEOUT)
    files = sorted(p.name for p in (tmp_path / "b" / "step-00000007").iterdir())
    if sharded:
        assert files == [C.CHECKPOINT_FILE, "optimizer-rank00-of02.pt", "optimizer-rank01-of02.pt"]
        manifest = C.latest_checkpoint(tmp_path / "b")
        assert manifest["sharded_optimizer"] and manifest["files"] == files
    else:
        assert files == [C.CHECKPOINT_FILE]
    resumed = run_ranks(
        _train_on_ranks, 2, tmp_path / "b", total, -1, True, sharded=sharded, timeout=TIMEOUT
    )
    for rank in range(2):
        for a, b in zip(straight[rank], resumed[rank], strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(straight[0][0], _initial_first_weight())  # it did train


def _initial_first_weight():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 16).weight.detach()


def test_resume_without_the_rank_generators_differs(tmp_path):
    """The same test fails when the RNG state is not restored: the check above can fail."""
    straight = run_ranks(_train_on_ranks, 2, tmp_path / "a", 12, 5, False, timeout=TIMEOUT)
    run_ranks(_train_on_ranks, 2, tmp_path / "b", 5, 5, False, timeout=TIMEOUT)
    resumed = run_ranks(
        _train_on_ranks, 2, tmp_path / "b", 12, -1, True, restore_rng=False, timeout=TIMEOUT
    )
    assert not torch.equal(straight[0][0], resumed[0][0])


def _load_with_world(directory, restore_rng):
    import torch.distributed as dist

    from dpcourse import runtime

    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    ).to(runtime.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        C.load_checkpoint(directory, model, opt, restore_rng=restore_rng)
    except ValueError as exc:
        return str(exc)
    return dist.get_world_size()


def test_a_different_world_size_is_a_clear_error(tmp_path):
    run_ranks(_train_on_ranks, 2, tmp_path, 3, 3, False, timeout=TIMEOUT)
    messages = run_ranks(_load_with_world, 3, tmp_path, True, timeout=TIMEOUT)
    assert all("written by 2 ranks and this job has 3" in m for m in messages)
    assert all("restore_rng=False" in m for m in messages)
    assert run_ranks(_load_with_world, 3, tmp_path, False, timeout=TIMEOUT) == [3, 3, 3]


def test_a_sharded_state_of_torch_optimizers_is_not_resharded(tmp_path):
    """Each rank's torch AdamW holds the state of its own parameters: on 3 ranks the files of 2
    cannot be cut again (chapter 9's ShardedOptimizer can: tests/test_zero_torch_loops.py)."""
    run_ranks(_train_on_ranks, 2, tmp_path, 3, 3, False, sharded=True, timeout=TIMEOUT)
    messages = run_ranks(_load_with_world, 3, tmp_path, False, timeout=TIMEOUT)
    assert all("sharded over 2 ranks" in m and "resume with 2 ranks" in m for m in messages)


def _rank_dies_while_saving(directory):
    """Rank 1 dies before writing its shard: the manifest must not name the new checkpoint."""
    import torch.distributed as dist

    from dpcourse import runtime

    model = torch.nn.Linear(3, 3).to(runtime.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    C.save_checkpoint(directory, 1, model, opt, sharded_optimizer=True)
    if dist.get_rank() == 1:
        os._exit(5)
    C.save_checkpoint(directory, 2, model, opt, sharded_optimizer=True)


def test_a_rank_dying_during_a_sharded_save_leaves_the_previous_manifest(tmp_path):
    with pytest.raises(RankError, match="died"):  # rank 0 may fail first (gloo), naming it
        run_ranks(_rank_dies_while_saving, 2, tmp_path, timeout=60)
    assert C.latest_checkpoint(tmp_path)["step"] == 1
