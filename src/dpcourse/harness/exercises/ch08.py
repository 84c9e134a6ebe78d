"""Checks for chapter 8's exercises (learning-rate warm-up, atomic saves, the order of a mixed
precision data-parallel step, SyncBatchNorm statistics, reading a recovery log).

Chapter 8: exercise checks for training at scale.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp import ddp
from dpcourse.harness.bench import elastic, recorded
from dpcourse.harness.exercises.core import (
    Mismatch,
    call_learner,
    call_learner_untouched,
    collectives_called,
    exercise,
    run_learner_on_ranks,
)
from dpcourse.harness.exercises.devices import as_on_gpus, expect_on_device_of
from dpcourse.practice import lr_schedule
from dpcourse.runtime import device

RANK_TIMEOUT = 60.0


# ------------------------------------------------------------------------------ ex-8-lr
@exercise("ex-8-lr", function="my_lr_at", timeout=10)
def lr_warmup(fn: Callable) -> str:
    """``fn(step, base_lr, world_size, warmup)``: the linear scaling rule with a linear warm-up
    from ``base_lr``, against :func:`dpcourse.practice.lr_schedule.lr_at`."""
    cases = [(s, 0.1, 8, 10) for s in (0, 1, 5, 9, 10, 11, 100)]
    cases += [(s, 0.03, 3, 4) for s in (0, 2, 4)] + [(0, 0.1, 4, 0), (7, 0.5, 1, 5)]
    for step, base, world, warmup in cases:
        want = lr_schedule.lr_at(step, base, world, warmup)
        got = call_learner(fn, step, base, world, warmup)
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-12 * max(1.0, abs(want)):
            where = f"step {step}, base_lr {base}, {world} ranks, warm-up {warmup} steps"
            hint = ""
            if isinstance(got, (int, float)):
                if step < warmup and abs(got - base * world) < 1e-12:
                    hint = " That is the full scaled rate: during warm-up it must ramp up to it."
                elif step < warmup and abs(got - base * world * step / warmup) < 1e-12:
                    hint = (
                        " Your ramp starts from 0; Goyal et al.'s starts from the single-rank "
                        "rate base_lr (a step of 0 wastes the first step)."
                    )
                elif abs(got - lr_schedule.lr_at(step, base, world, warmup, "sqrt")) < 1e-12:
                    hint = " That is the square-root rule; this exercise asks for the linear one."
                elif step >= warmup and abs(got - base) < 1e-12:
                    hint = " After the warm-up the rate is base_lr x world_size."
            raise Mismatch(f"{where}: expected {want:.6g}, got {got!r}.{hint}")
    return "ramps linearly from base_lr to N x base_lr over the warm-up, then stays there"


# ------------------------------------------------------------------------- ex-8-atomic
class _Unpicklable:
    """Makes torch.save fail half-way through writing, like a full disk or a crash."""

    def __reduce__(self):
        raise OSError("simulated failure in the middle of writing the checkpoint")


@exercise("ex-8-atomic", function="my_atomic_save", timeout=30)
def atomic_save(fn: Callable) -> str:
    """``fn(obj, path)`` must save ``obj`` with ``torch.save`` so that a failure during the write
    leaves the previous file at ``path`` intact: temporary file in the same directory, fsync,
    ``os.replace``, in that order (the temporary file fsynced before it is renamed; the old file
    never removed first), and the failure raised to the caller. ``path`` is a ``str`` once and a
    ``pathlib.Path`` once, as callers pass either."""
    renames: list[tuple[str, str]] = []
    fsyncs: list[int] = []
    # ("fsync", inode), ("rename", inode of the file renamed), ("remove", path): in order
    events: list[tuple[str, int | str]] = []
    real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync
    real_remove, real_unlink = os.remove, os.unlink

    def inode(path) -> int:
        try:
            return os.stat(path).st_ino
        except OSError:
            return -1

    def spy_replace(src, dst, *a, **k):
        renames.append((os.fspath(src), os.fspath(dst)))
        events.append(("rename", inode(src)))
        return real_replace(src, dst, *a, **k)

    def spy_rename(src, dst, *a, **k):
        renames.append((os.fspath(src), os.fspath(dst)))
        events.append(("rename", inode(src)))
        return real_rename(src, dst, *a, **k)

    def spy_fsync(fd):
        fsyncs.append(fd)
        try:
            events.append(("fsync", os.fstat(fd).st_ino))
        except (OSError, TypeError, ValueError):
            pass
        return real_fsync(fd)

    def spy_remove(path, *a, **k):
        events.append(("remove", os.path.realpath(path)))
        return real_remove(path, *a, **k)

    def spy_unlink(path, *a, **k):
        events.append(("remove", os.path.realpath(path)))
        return real_unlink(path, *a, **k)

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "ckpt" / "latest.pt"
        target.parent.mkdir()
        first = {"step": 1, "w": torch.arange(6.0)}
        os.replace, os.rename, os.fsync = spy_replace, spy_rename, spy_fsync
        os.remove, os.unlink = spy_remove, spy_unlink
        raised = True
        try:
            call_learner(fn, first, str(target))
            good = {"step": 2, "w": torch.arange(6.0) * 2}
            events.clear()  # the second save overwrites a file: its order is the one looked at
            try:
                call_learner(fn, good, target)  # a pathlib.Path this time
            except Mismatch as exc:
                raise Mismatch(f"saving to a pathlib.Path (callers pass str or Path): {exc}") \
                    from None
            renames_before_failure, second_save = list(renames), list(events)
            try:
                fn({"step": 3, "w": torch.zeros(1000), "bad": _Unpicklable()}, str(target))
                raised = False
            except NotImplementedError:
                raise
            except Exception:
                pass  # right: the caller must know the save failed
        finally:
            os.replace, os.rename, os.fsync = real_replace, real_rename, real_fsync
            os.remove, os.unlink = real_remove, real_unlink
        if not target.exists():
            raise Mismatch(f"after saving, {target.name} does not exist")
        try:
            got = torch.load(target, weights_only=True)
        except Exception as exc:
            raise Mismatch(
                "a failure in the middle of the third save left a corrupt file at the target "
                f"({type(exc).__name__} when loading it): write to a temporary file and rename "
                "it over the target only once it is complete"
            ) from None
        if got.get("step") != 2 or not torch.equal(got["w"], good["w"]):
            raise Mismatch(
                f"after a failed save the file holds step {got.get('step')!r}, expected the "
                "previous checkpoint (step 2) to be left untouched"
            )
        if not renames_before_failure:
            raise Mismatch(
                "the file was not renamed into place: write to a temporary file, then "
                "os.replace(temporary, path), which is atomic"
            )
        src, dst = renames_before_failure[-1]
        if Path(src).resolve().parent != target.resolve().parent:
            raise Mismatch(
                f"the temporary file was in {Path(src).parent}, not next to the target: "
                "os.replace is atomic only within one file system, so create it in the target's "
                "directory (tempfile.mkstemp(dir=...))"
            )
        if not fsyncs:
            raise Mismatch(
                "os.fsync was never called: flush and fsync the temporary file before the "
                "rename, or after a power cut the new name can point to a file whose bytes never "
                "reached the disk"
            )
        _expect_order(second_save, os.path.realpath(target))
        if not raised:
            raise Mismatch(
                "when torch.save failed half-way, your function returned as if the checkpoint "
                "were saved: clean up the temporary file, then re-raise (`raise` in the except "
                "block), so that the caller knows the newest checkpoint is still the old one"
            )
        leftovers = [p.name for p in target.parent.iterdir() if p.name != target.name]
        if leftovers:
            raise Mismatch(
                f"files were left next to the target: {leftovers}. Remove the temporary file "
                "when the write fails (try/except, then re-raise)"
            )
    return "a failed write leaves the previous file intact; temporary file beside it, fsynced"


def _expect_order(events: list[tuple[str, int | str]], target: str) -> None:
    """The second save's file operations, which replace an existing checkpoint: the file renamed
    into place must have been fsynced before the rename, and the old checkpoint must not have
    been removed before it (a crash in between would leave none)."""
    renamed = next((i for i, (kind, _) in enumerate(events) if kind == "rename"), None)
    if renamed is None:
        return  # not renamed: said above
    removed = [i for i, (kind, what) in enumerate(events[:renamed])
               if kind == "remove" and what == target]
    if removed:
        raise Mismatch(
            "you removed the old checkpoint before renaming the new one into place: a crash "
            "between the two leaves no checkpoint at all. os.replace(temporary, path) replaces "
            "the old file in one atomic step: no need to remove it first"
        )
    moved = events[renamed][1]
    synced = [i for i, (kind, what) in enumerate(events) if kind == "fsync" and what == moved]
    if synced and synced[0] > renamed:
        raise Mismatch(
            "you fsynced the temporary file after renaming it into place: until the fsync its "
            "bytes may not be on the disk, so a power cut in between leaves the name pointing "
            "to an incomplete file. Write, flush, fsync, then os.replace"
        )


# --------------------------------------------------------------------------- ex-8-amp
# The ways to order the steps between backward and scaler.step, the right one first.
VARIANTS = {
    "reduce_then_unscale": ("reduce", "unscale", "clip"),
    "clip_then_reduce": ("unscale", "clip", "reduce"),
    "no_clip": ("reduce", "unscale"),
    "clip_scaled": ("reduce", "clip", "unscale"),
    "no_all_reduce": ("unscale", "clip"),
    "unscale_then_reduce": ("unscale", "reduce", "clip"),
    # not orders but the other things a step can get wrong, told apart the same way
    "no_zero_grad": ("reduce", "unscale", "clip"),
    "float32_forward": ("reduce", "unscale", "clip"),
    "bfloat16_forward": ("reduce", "unscale", "clip"),
}
MAX_NORM = 0.05


def _variant_step(model, x, y, optimizer, scaler, order):
    dtype = torch.bfloat16 if order == "bfloat16_forward" else torch.float16
    with torch.autocast(x.device.type, dtype=dtype, enabled=order != "float32_forward"):
        loss = nn.functional.mse_loss(model(x), y)
    if order != "no_zero_grad":
        optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    actions = {
        "reduce": lambda: ddp.all_reduce_gradients(model),
        "unscale": lambda: scaler.unscale_(optimizer),
        "clip": lambda: nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
    }
    for action in VARIANTS[order]:
        actions[action]()
    scaler.step(optimizer)
    scaler.update()


def _amp_setup(rank: int):
    dev = device()  # the rank's device (NCCL all-reduces only CUDA tensors)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**10)
    g = torch.Generator().manual_seed(10 + rank)  # every rank its own data
    batches = [(torch.randn(8, 6, generator=g) * (1 + rank), torch.randn(8, 2, generator=g))
               for _ in range(3)]  # fmt: skip
    x_bad = batches[0][0].clone()
    if rank == 1:
        x_bad[0, 0] = 1e30  # rank 1's forward overflows float16: its gradients are inf/NaN
    batches.append((x_bad, batches[0][1]))
    return model, optimizer, scaler, [(x.to(dev), y.to(dev)) for x, y in batches]


def _amp_on_rank(fn: Callable) -> list[str]:
    """Runs on every rank: the learner's step against the right order and the wrong ones."""

    rank = dist.get_rank()
    model, optimizer, scaler, batches = _amp_setup(rank)
    learner = []
    for x, y in batches:
        call_learner(fn, model, x, y, optimizer, scaler, MAX_NORM)
        learner.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    runs = {}
    for order in VARIANTS:
        m, o, s, _ = _amp_setup(rank)
        states = []
        for x, y in batches:
            _variant_step(m, x, y, o, s, order)
            states.append(([p.detach().clone() for p in m.parameters()], s.get_scale()))
        runs[order] = states

    def same(a, b):
        return a[1] == b[1] and all(
            torch.allclose(p, q, rtol=1e-6, atol=1e-7, equal_nan=True)
            for p, q in zip(a[0], b[0], strict=True)
        )

    hints = {  # the first that matches is shown: unscale-then-reduce differs only at the inf
        "unscale_then_reduce": "you unscaled before the all-reduce: only rank 1 saw its inf, "
        "so rank 0 stepped on inf gradients while rank 1 skipped; all-reduce first, then unscale",
        "clip_then_reduce": "you clipped each rank's gradient before the all-reduce; clip the "
        "averaged gradient (its norm is the one a single device would see)",
        "no_clip": "the gradients were not clipped: clip_grad_norm_(..., max_norm) after unscaling",
        "clip_scaled": "you clipped before unscaling, so the norm you limited was S times too "
        "large; call scaler.unscale_(optimizer) first",
        "no_all_reduce": "the gradients were not averaged over the ranks",
        "no_zero_grad": "the gradients of the steps before were still there: zero them "
        "(optimizer.zero_grad(set_to_none=True)) before backward, or they accumulate",
        "float32_forward": "your forward did not run in float16 on this device: use "
        "torch.autocast(x.device.type, dtype=torch.float16), which follows the batch to "
        "whatever device it is on (a hard-coded 'cuda' autocasts nothing on a CPU)",
        "bfloat16_forward": "your forward ran in bfloat16; the exercise asks for float16 "
        "autocast, the dtype that needs the loss scaling",
    }
    for i, got in enumerate(learner):
        if same(got, runs["reduce_then_unscale"][i]):
            continue
        what = "the step where rank 1 overflowed" if i == 3 else f"step {i + 1}"
        for order, hint in hints.items():
            if same(got, runs[order][i]):
                return [f"after {what}: {hint}"]
        return [
            f"after {what}, rank {rank}'s weights (or loss scale {got[1]:g}) differ from the "
            "right order's: autocast forward, scaler.scale(loss).backward(), average the "
            "gradients, scaler.unscale_, clip, scaler.step, scaler.update"
        ]
    return []


@exercise("ex-8-amp", function="my_amp_step", timeout=120)
def amp_step(fn: Callable) -> str:
    """``fn(model, x, y, optimizer, scaler, max_norm)`` on 2 ranks: three float16 steps and one
    where rank 1's gradients overflow, against the right order and five wrong ones, and steps
    that forget zero_grad, autocast on the batch's device or its float16 dtype."""
    results = run_learner_on_ranks(_amp_on_rank, 2, fn, timeout=RANK_TIMEOUT)
    problems = [p for r in results for p in r]
    if problems:
        raise Mismatch(problems[0])
    return (
        "same weights and loss scale as the right order on both ranks, and both skipped the "
        "step where one rank overflowed"
    )


# ------------------------------------------------------------------------ ex-8-syncbn
def _stats_on_rank(fn: Callable, sizes: list[int]) -> list[str]:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(len(sizes))
    full = torch.randn(sum(sizes), 3, generator=g, dtype=torch.float64)
    offsets = torch.arange(len(sizes), dtype=torch.float64)  # ranks' batches differ in mean
    full += torch.repeat_interleave(offsets, torch.tensor(sizes)).unsqueeze(1)
    start = sum(sizes[:rank])
    mine = full[start : start + sizes[rank]]
    where = f"{len(sizes)} ranks with batches of {sizes}"
    x = mine.clone().to(device())  # float64 on the rank's device, modelled on a GPU on a CPU
    try:
        with collectives_called() as calls, as_on_gpus(device=[x]):
            got = call_learner_untouched(fn, ["x"], x)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return [f"{where}: expected (mean, var), got {type(got).__name__}"]
        for name, t in zip(("mean", "var"), got, strict=True):
            if not isinstance(t, torch.Tensor):
                return [f"{where}: expected (mean, var) as two tensors, got the {name} as "
                        f"{type(t).__name__}"]
            expect_on_device_of(t, x, f"the {name}")
    except Mismatch as exc:
        return [f"{where}: {exc}"]
    mean, var = (t.cpu() for t in got)
    for name, t in (("mean", mean), ("var", var)):
        if t.shape != (full.shape[1],) or t.dtype != full.dtype:
            return [f"{where}: your {name} has shape {tuple(t.shape)} and dtype {t.dtype}; "
                    f"expected shape ({full.shape[1]},), one value per channel, in x's dtype "
                    f"{full.dtype} (statistics kept in a lower precision than the input lose "
                    "digits)"]

    want_mean, want_var = full.mean(0), full.var(0, unbiased=False)
    chunks = torch.split(full, sizes)
    mean_of_means = torch.stack([c.mean(0) for c in chunks]).mean(0)
    mean_of_vars = torch.stack([c.var(0, unbiased=False) for c in chunks]).mean(0)
    ok = lambda a, b: isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b)  # noqa: E731
    if not ok(mean, want_mean):
        if ok(mean, mean_of_means):
            return [
                f"{where}: your mean is the mean of the ranks' means, which weighs a batch "
                "of 2 like a batch of 9: all-reduce the sums and the counts, then divide"
            ]
        if ok(mean, mine.mean(0)):
            return [f"{where}: your mean is this rank's own: all-reduce the sums"]
        return [f"{where}: rank {rank}'s mean is {mean!r}, expected {want_mean}"]
    if not ok(var, want_var):
        if ok(var, full.var(0, unbiased=True)):
            return [
                f"{where}: that is the unbiased variance (divided by count - 1); batch norm "
                "normalises with the biased one (divided by count)"
            ]
        if ok(var, mean_of_vars):
            return [
                f"{where}: the mean of the ranks' variances misses the spread between the "
                "ranks' means: all-reduce the sums of squares and use E[x²] - E[x]²"
            ]
        return [f"{where}: rank {rank}'s variance is {var!r}, expected {want_var}"]
    if len(calls) > 1:
        return [f"{where}: rank {rank} called {len(calls)} collectives ({', '.join(calls)}); "
                "one is enough: put the sums, the sums of squares and the count in one tensor "
                "(torch.cat) and all-reduce it once, one latency instead of several"]
    return []


@exercise("ex-8-syncbn", function="my_global_stats", timeout=120)
def syncbn_stats(fn: Callable) -> str:
    """``fn(x)`` with ``x`` of shape ``(B_r, C)`` on each rank returns the global batch's
    per-channel ``(mean, biased variance)``, on 3 ranks with uneven batches and on 2: float64
    tensors of shape ``(C,)`` on ``x``'s device (modelled on a GPU on a CPU), with one
    collective, ``x`` left untouched."""
    for sizes in ([2, 5, 9], [4, 4]):
        results = run_learner_on_ranks(_stats_on_rank, len(sizes), fn, sizes, timeout=RANK_TIMEOUT)
        problems = [p for r in results for p in r]
        if problems:
            raise Mismatch(problems[0])
    return "the mean and variance of the whole batch on every rank, for uneven batches too"


# ------------------------------------------------------------------------ ex-8-recovery
@exercise("ex-8-recovery", function="my_recovery_reading", timeout=10)
def recovery_reading(fn: Callable) -> str:
    """``fn()`` returns ``{"node": <the node that failed>, "step": <the step the job resumed
    from>}`` for the recovery log section 8.6 shows: node 0's output in the recorded elastic run
    whose node 1 was killed (``benchmarks/cpu-2core/elastic.json``)."""
    record = recorded("elastic")
    if record is None:
        raise Mismatch("the recorded elastic run (benchmarks/cpu-2core/elastic.json) is not "
                       "here: check this exercise in a clone of the course's repository")
    lines = elastic.recovery_log(record)
    failed = int(record["kill"]["fault"].split(":")[0].split()[-1])  # "node 1: ..."
    resumed = elastic.resumed_step(lines)
    last = elastic.last_step_before_failure(lines)
    got = call_learner(fn)
    if not isinstance(got, dict) or set(got) != {"node", "step"}:
        raise Mismatch(f'expected a dict {{"node": ..., "step": ...}}, got {got!r}')
    node, step = got["node"], got["step"]
    for name, value in (("node", node), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise Mismatch(f"the {name}: expected an int, got {value!r}")
    if node != failed:
        if node == 0:
            raise Mismatch(
                "node 0 printed this log, and it did not fail: its worker raised because the "
                "peer it was all-reducing with went away, and its agent restarted it. The error "
                "names that peer by its address; node i has the address ending in .(i+1)"
            )
        raise Mismatch(f"the cluster had nodes 0 and 1; the error names the peer's address, and "
                       f"node i's address ends in .(i+1). Got node {node}")
    if step != resumed:
        if last is not None and step == last and last != resumed:
            raise Mismatch(
                f"step {last} was the last step logged before the failure, but no checkpoint "
                f"kept it: the trainer saves every 4 steps and the restarted job starts from the "
                f"newest checkpoint, so steps {resumed + 1} to {last} were done twice. Look for "
                "the line 'resumed from ... at step N'"
            )
        if step == 0:
            raise Mismatch("the job did not start over: the restarted workers found a "
                           "checkpoint (the line 'resumed from ... at step N')")
        raise Mismatch(f"step {step} is not where the job resumed: look for the line 'resumed "
                       "from ... at step N' after the restart")
    redone = f"; steps {resumed + 1} to {last} were done again" if last and last > resumed else ""
    return f"node {failed} failed; the job resumed from the checkpoint of step {resumed}{redone}"
