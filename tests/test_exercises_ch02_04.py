"""The checks of chapters 2-4's exercises: the reference solutions (the package's functions and
the solution cells of the notebooks) pass, and plausible wrong answers fail with a message that
names the problem."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from pathlib import Path

import pytest
import torch

from dpcourse.harness.exercises import ch02, registry, run_check
from dpcourse.replicas import averaging, parameter_averaging, replication, scatter_gather

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = {2: "02_data_parallel_idea", 3: "03_manual_replication", 4: "04_naive_averaging"}


def notebook_solutions(chapter: int) -> dict:
    """The functions defined by a chapter's solution cells (tagged "solution")."""
    nb = json.loads((ROOT / "chapters" / f"{CHAPTERS[chapter]}.ipynb").read_text())
    namespace = {"copy": copy, "torch": torch, "replication": replication,
                 "scatter_gather": scatter_gather,
                 "averaging": averaging}
    for cell in nb["cells"]:
        if "solution" in cell.get("metadata", {}).get("tags", []):
            exec("".join(cell["source"]), namespace)
    return namespace


def expect_pass(label: str, fn) -> None:
    result = run_check(label, fn)
    assert result.passed, result.text()


def expect_fail(label: str, fn, *phrases: str) -> None:
    result = run_check(label, fn)
    assert result.status == "failed", result.text()
    for phrase in phrases:
        assert phrase in result.message, f"{phrase!r} not in: {result.message}"


def test_every_check_of_chapters_2_to_4_has_its_solution_in_the_notebook():
    labels = {ex.label: ex for ex in registry().values() if 2 <= ex.chapter <= 4}
    assert len([lb for lb in labels if lb.startswith("ex-2-")]) >= 1
    assert len([lb for lb in labels if lb.startswith("ex-3-")]) >= 1
    assert len([lb for lb in labels if lb.startswith("ex-4-")]) >= 1
    for chapter in CHAPTERS:
        solutions = notebook_solutions(chapter)
        for ex in labels.values():
            if ex.chapter == chapter:
                assert ex.function in solutions, f"{ex.label}: no solution cell defines it"
                expect_pass(ex.label, solutions[ex.function])


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_each_chapter_has_at_least_three_exercises(chapter):
    text = (ROOT / "chapters" / f"{CHAPTERS[chapter]}.ipynb").read_text()
    assert text.count(f":label: ex-{chapter}-") >= 3
    assert text.count("{solution} ex-") >= 3


# ----------------------------------------------------------------------------- chapter 2
def test_combine_gradients():
    expect_pass("ex-2-combine",
                lambda grads, sizes: sum(s / sum(sizes) * g for s, g in zip(sizes, grads,
                                                                             strict=True)))
    expect_fail("ex-2-combine", lambda grads, sizes: sum(grads) / len(grads),
                "shards of sizes [34, 34, 32]", "plain mean")
    expect_fail("ex-2-combine", lambda grads, sizes: sum(grads), "sum", "2 times too large")
    expect_fail("ex-2-combine",
                lambda grads, sizes: sum(s * g for s, g in zip(sizes, grads, strict=True)),
                "shards of sizes [50, 50]", "gradient of fc1.weight", "values differ")


def one_after_another(replicas, inputs):
    return [r(*x) for r, x in zip(replicas, inputs, strict=True)]


def _in_threads(replicas, inputs, *, keep_order=True, grad_mode=True, catch=False):
    """Threads, with each of parallel-apply's three duties optional."""
    results, errors = [None] * len(replicas), []
    grad = torch.is_grad_enabled()

    def work(i):
        try:
            with torch.set_grad_enabled(grad) if grad_mode else contextlib.nullcontext():
                out = replicas[i](*inputs[i])
        except Exception as exc:
            if not catch:
                raise
            errors.append(exc)
            return
        if keep_order:
            results[i] = out
        else:
            results.append(out)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results if keep_order else [r for r in results if r is not None]


def test_parallel_apply(monkeypatch):
    monkeypatch.setattr(ch02, "BARRIER_TIMEOUT", 1.0)
    expect_pass("ex-2-threads", scatter_gather.parallel_apply)
    expect_pass("ex-2-threads", lambda r, x: _in_threads(r, x, catch=True))
    expect_fail("ex-2-threads", one_after_another, "4 replicas", "ran one after another",
                "threading.Thread")
    expect_fail("ex-2-threads", lambda r, x: _in_threads(r, x, keep_order=False, catch=True),
                "output 0 is replica 3's output", "not in the order the threads finish")
    expect_fail("ex-2-threads", lambda r, x: _in_threads(r, x, grad_mode=False, catch=True),
                "3 replicas under torch.no_grad()", "Grad mode is a per-thread setting")
    expect_fail("ex-2-threads", _in_threads, "replica 1 raised ValueError in its thread",
                "returned list instead of raising")

    def vague(replicas, inputs):
        try:
            return _in_threads(replicas, inputs, catch=True)
        except ValueError:
            raise RuntimeError("a replica failed") from None

    expect_fail("ex-2-threads", vague, "which does not say so")
    expect_fail("ex-2-threads", lambda r, x: scatter_gather.parallel_apply(r, x),
                "ready-made parallel_apply")
    expect_fail("ex-2-threads", lambda r, x: torch.nn.parallel.parallel_apply(r, x),
                "ready-made parallel_apply")


# ----------------------------------------------------------------------------- chapter 3
def test_chunk_data():
    expect_pass("ex-3-chunk", scatter_gather.chunk_data)

    def floor_chunks(batch, n):
        size = len(batch) // n
        return [batch[i * size:(i + 1) * size] for i in range(n - 1)] + [batch[(n - 1) * size:]]

    def off_by_one(batch, n):
        c = -(-len(batch) // n)
        return [batch[s:s + c + 1] for s in range(0, len(batch), c)]

    def never_refuses(batch, n):
        return list(torch.chunk(batch, n)) if len(batch) else [batch] * n

    expect_fail("ex-3-chunk", floor_chunks, "batch of 30 into 4", "[8, 8, 8, 6]", "ceil(30/4)")
    expect_fail("ex-3-chunk", off_by_one, "batch of 30 into 4", "in all, not 30")
    expect_fail("ex-3-chunk", never_refuses, "a batch of 3 into 4 chunks should raise a ValueError")


def test_create_replicas():
    expect_pass("ex-3-replicas", replication.create_replicas)

    def shallow(model, devices):
        return [copy.copy(model).to(d) for d in devices]

    def newly_built(model, devices):
        return [type(model)().to(d) for d in devices]

    def shared(model, devices):
        replica = replication.device_copy(model, devices[0])
        return [replica] * len(devices)

    expect_fail("ex-3-replicas", lambda model, devices: [model] * len(devices),
                "replica 0 is the model itself")
    expect_fail("ex-3-replicas", shallow, "replica 0 shares parameter memory with the model")
    expect_fail("ex-3-replicas", newly_built, "differ from the model's", "newly built")
    expect_fail("ex-3-replicas", shared, "replicas 0 and 1 are the same object")


def _step(average=False, broadcast=True, only_first=False, mistake=None):
    """A manual data-parallel step with one of three mistakes switched on, or one of issue 43's
    ``mistake``s: "every replica" (the replicas' gradients summed whether or not a replica got a
    chunk), "on the replica's device" (never moved to the master's), "a tensor" (returned)."""

    def step(master, replicas, batch, loss_fn, optimizer):
        x, y = batch
        if broadcast:
            replication.broadcast_parameters(master, replicas)
        for r in replicas:
            r.zero_grad(set_to_none=True)
        devices = [replication.module_device(r) for r in replicas]
        chunks = scatter_gather.scatter(x, devices)
        out = scatter_gather.gather(scatter_gather.parallel_apply(replicas, chunks), devices[0])
        loss = loss_fn(out, y.to(devices[0]))
        loss.backward()
        used = replicas[:1] if only_first else replicas[: len(chunks)]
        used = replicas if mistake == "every replica" else used
        for p, *copies in zip(master.parameters(), *(r.parameters() for r in used), strict=True):
            if mistake == "on the replica's device":
                p.grad = sum(c.grad for c in copies)
            else:
                p.grad = sum(c.grad.to(p.device) for c in copies)  # the master is on the host
            if average:
                p.grad = p.grad / len(copies)
        optimizer.step()
        return loss if mistake == "a tensor" else loss.item()

    return step


def test_data_parallel_step():
    expect_pass("ex-3-step", replication.data_parallel_step)
    expect_pass("ex-3-step", _step())
    expect_fail("ex-3-step", _step(average=True), "2 replicas", "1/2 of one device's",
                "do not average")
    expect_fail("ex-3-step", _step(broadcast=False), "Step 0 was right but step 1 is not",
                "copy the master's new weights")
    expect_fail("ex-3-step", _step(only_first=True), "2 replica(s), step 0",
                "did every replica's gradient reach the master")


# ----------------------------------------------------------------------------- chapter 4
def test_average_gradients():
    expect_pass("ex-4-weighted",
                lambda replicas, sizes: averaging.average_gradients(replicas, weights=sizes))
    expect_fail("ex-4-weighted", lambda replicas, sizes: averaging.average_gradients(replicas),
                "shards of sizes [10, 10, 4, 16]", "plain mean")

    def only_first(replicas, sizes):
        total = sum(sizes)
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            params[0].grad = sum(s / total * p.grad for s, p in zip(sizes, params, strict=True))

    def forgets_frozen(replicas, sizes):
        total = sum(sizes)
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            mean = sum(s / total * p.grad for s, p in zip(sizes, params, strict=True))
            for p in params:
                p.grad = mean.clone()

    expect_fail("ex-4-weighted", only_first, "replica 1's gradient of fc1.weight is unchanged")
    expect_fail("ex-4-weighted", forgets_frozen, "with fc1 frozen", "raised TypeError")


def test_average_parameters():
    expect_pass("ex-4-params", parameter_averaging.average_parameters)

    def summed(replicas):
        with torch.no_grad():
            for params in zip(*(r.parameters() for r in replicas), strict=True):
                total = sum(p.detach().clone() for p in params)
                for p in params:
                    p.copy_(total)

    def only_first(replicas):
        with torch.no_grad():
            for params in zip(*(r.parameters() for r in replicas), strict=True):
                params[0].copy_(sum(p for p in params) / len(params))

    def gradients_instead(replicas):
        averaging.average_gradients(replicas)

    expect_fail("ex-4-params", summed, "is the sum of the replicas' values", "divide by 2")
    expect_fail("ex-4-params", only_first, "replica 1's fc1.weight did not change")
    expect_fail("ex-4-params", gradients_instead, "did not change")


# ------------------------------------------------ the wrong answers students write (issue 43)
# Each of issue 43's kinds: an input the check never varied (dtypes, shapes, edge sizes), a
# property it never observed (inputs changed, replicas sharing a tensor, copies for views), a
# device it never varied (made visible on the CPU: the meta device, or the device audit's tags
# through core.as_on_gpus), and an answer that made the check itself fail.
def combine_in_place(grads, sizes):
    """Kind 2: accumulates into the first shard's gradient, which is the caller's."""
    total = sum(sizes)
    out = grads[0].mul_(sizes[0] / total)
    for size, g in zip(sizes[1:], grads[1:], strict=True):
        out.add_(g, alpha=size / total)
    return out


def combine_in_float32(grads, sizes):
    """Kind 1 (dtype) and kind 4: float32 weights; the check used to raise 'Float did not match
    Double' from inside itself."""
    weights = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
    return sum(w * g.float() for w, g in zip(weights, grads, strict=True))


def combine_stacked(grads, sizes):
    """Kind 1 (dtype): a float32 weight tensor broadcast against the stacked gradients: float64
    gradients come back float64, but weighed with rounded weights."""
    weights = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
    stacked = torch.stack(grads)
    return (stacked * weights.view(-1, *[1] * grads[0].dim())).sum(0)


def combine_flat(grads, sizes):
    """Kind 1 (shape): flattens the gradients and forgets to give them their shape back."""
    total = sum(sizes)
    return sum(size / total * g.reshape(-1) for size, g in zip(sizes, grads, strict=True))


def test_combine_rejects_what_students_write():
    expect_fail("ex-2-combine", combine_in_place, "changed its argument shard_grads[0]")
    expect_fail("ex-2-combine", combine_in_float32, "your result is torch.float32",
                "the gradients are torch.float64")
    expect_fail("ex-2-combine", combine_stacked, "float64", "values differ")
    expect_fail("ex-2-combine", combine_flat, "expected shape (32, 5), got shape (160,)")


def first_input_only(replicas, inputs):
    """Kind 1: every replica in a thread, with the caller's grad mode and its errors raised, but
    given inputs[i][0], as if a forward took one tensor."""
    results, errors, grad = [None] * len(replicas), [None] * len(replicas), torch.is_grad_enabled()

    def work(i):
        try:
            with torch.set_grad_enabled(grad):
                results[i] = replicas[i](inputs[i][0])
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def test_parallel_apply_passes_every_input(monkeypatch):
    monkeypatch.setattr(ch02, "BARRIER_TIMEOUT", 1.0)
    expect_fail("ex-2-threads", first_input_only, "forward takes two tensors",
                "call replicas[i](*inputs[i])")


def chunks_copied(batch, n):
    """Kind 2: the right chunks, copied instead of views of the batch."""
    if len(batch) < n or len(batch) == 0:
        raise ValueError("use at least n samples")
    per = -(-len(batch) // n)
    return [batch[start:start + per].clone() for start in range(0, len(batch), per)]


def chunks_of_numbers(batch, n):
    """Kind 1 (shape): right for a batch of numbers; a batch of rows comes out flattened."""
    if len(batch) < n or len(batch) == 0:
        raise ValueError("use at least n samples")
    flat, per = batch.reshape(-1), -(-len(batch) // n)
    width = flat.numel() // len(batch)
    return [flat[start * width:(start + per) * width] for start in range(0, len(batch), per)]


def test_chunk_rejects_what_students_write():
    expect_fail("ex-3-chunk", chunks_copied, "chunk 0 is a copy", "views")
    expect_fail("ex-3-chunk", chunks_of_numbers, "a batch of shape (10, 3) into 4")


def replicas_left_in_place(model, devices):
    """Kind 3: independent copies, but each left on the model's device."""
    replicas = []
    for _ in devices:
        replica = copy.deepcopy(model)
        for p in replica.parameters():
            p.grad = None
        replicas.append(replica)
    return replicas


def test_create_replicas_puts_each_on_its_device(rejects):
    rejects("ex-3-replicas", replicas_left_in_place, "devices [cpu, meta]",
                "replica 1 is on cpu, expected meta")


def test_data_parallel_step_rejects_what_students_write(rejects):
    rejects("ex-3-step", _step(mistake="on the replica's device"), "the replicas on a GPU",
                "on a machine with GPUs", "p.grad = sum(c.grad for c in copies)")
    # kind 1, an edge size: 6 samples on 4 replicas make 3 chunks, and replica 3 has no gradient
    expect_fail("ex-3-step", _step(mistake="every replica"), "4 replica(s), step 1",
                "so a replica gets none", "raised")
    expect_fail("ex-3-step", _step(mistake="a tensor"), "you returned a tensor", "loss.item()")


def _average_gradients(mistake):
    """The weighted mean of the replicas' gradients with one of three mistakes: "shared" (kind
    2: every replica's .grad set to one tensor), "on the devices" (kind 3: the weighted sum
    computed across the replicas' devices, not on the CPU), "left on the CPU" (kind 3: the mean
    given to every replica where it was computed)."""

    def average(replicas, sizes):
        total = sum(sizes)
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            if not params[0].requires_grad:
                continue
            where = (lambda g: g) if mistake == "on the devices" else (lambda g: g.to("cpu"))
            mean = sum(s / total * where(p.grad) for s, p in zip(sizes, params, strict=True))
            for p in params:
                if mistake == "shared":
                    p.grad = mean
                elif mistake == "left on the CPU":
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)

    return average


def test_average_gradients_rejects_what_students_write(rejects):
    rejects("ex-4-weighted", _average_gradients("shared"), "replicas 0 and 1 share one tensor",
                "p.grad.copy_(mean)")
    rejects("ex-4-weighted", _average_gradients("on the devices"),
                "replica 0 on the CPU and the others on a GPU", "on a machine with GPUs")
    rejects("ex-4-weighted", _average_gradients("left on the CPU"),
                "replica 0 on the CPU and the others on a GPU",
                "a gradient on the host was assigned to a parameter on the device")


def params_shared(replicas):
    """Kind 2: every replica's parameter data set to one tensor."""
    with torch.no_grad():
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            mean = sum(p.detach().to("cpu") for p in params) / len(params)
            for p in params:
                p.data = mean


def params_in_float32(replicas):
    """Kind 1 (dtype): a float32 accumulator, and p.data replaced by it."""
    with torch.no_grad():
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            mean = torch.zeros(params[0].shape)
            for p in params:
                mean += p.to("cpu").float()
            for p in params:
                p.data = (mean / len(params)).to(p.device)


def params_stacked(replicas):
    """Kind 3: the replicas' parameters stacked together, wherever they are."""
    with torch.no_grad():
        for params in zip(*(r.parameters() for r in replicas), strict=True):
            mean = torch.stack(list(params)).mean(0)
            for p in params:
                p.copy_(mean)


def test_average_parameters_rejects_what_students_write(rejects):
    rejects("ex-4-params", params_shared, "replicas 0 and 1 share one tensor",
                "p.copy_(mean)")
    rejects("ex-4-params", params_in_float32, "3 replicas in float64", "is now torch.float32")
    rejects("ex-4-params", params_stacked, "replica 0 on the CPU and the others on a GPU",
                "stack() got host tensor")
