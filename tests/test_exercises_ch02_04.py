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


def _step(average=False, broadcast=True, only_first=False):
    """A manual data-parallel step with one of three mistakes switched on."""

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
        for p, *copies in zip(master.parameters(), *(r.parameters() for r in used), strict=True):
            p.grad = sum(c.grad.to(p.device) for c in copies)  # the master is on the host
            if average:
                p.grad = p.grad / len(copies)
        optimizer.step()
        return loss.item()

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
