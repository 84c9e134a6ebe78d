"""Checks for chapter 2's exercises (the idea of data parallelism, ``nn.DataParallel``).

Chapter 2: the idea of data parallelism, ``nn.DataParallel``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.parallel as torch_parallel
from torch import nn

from dpcourse.harness.exercises.core import (
    Mismatch,
    NotAttempted,
    about,
    call_learner,
    call_learner_untouched,
    exercise,
    expect_close,
    expect_type,
)
from dpcourse.one_device import data, models
from dpcourse.replicas import replication, scatter_gather


def _shard_gradients(sizes: list[int], dtype: torch.dtype, name: str):
    """Gradients of the MLP's parameter ``name`` on shards of the given sizes, and of the whole
    batch (computed in float64, then given in ``dtype``)."""
    x, y = data.random_regression(num_samples=sum(sizes)).tensors
    x, y = x.double(), y.double()
    torch.manual_seed(0)
    model = models.MLP().double()
    loss = nn.MSELoss()
    whole = replication.gradients(model, (x, y), loss)[name]
    shards = zip(x.split(sizes), y.split(sizes), strict=True)
    parts = [replication.gradients(model, s, loss)[name].to(dtype) for s in shards]
    total = sum(sizes)
    if dtype != torch.float64:  # the best the learner can do from the rounded parts
        whole = sum(n / total * p.double() for n, p in zip(sizes, parts, strict=True))
    return parts, whole.to(dtype)


# (shard sizes, dtype, parameter): equal and uneven shards, one shard, 1-D and 2-D gradients,
# in the dtypes a gradient comes in (a float32 weight has a float32 gradient, and .grad takes
# nothing else)
COMBINE_CASES = [
    ([50, 50], torch.float64, "fc1.weight"),
    ([34, 34, 32], torch.float64, "fc1.weight"),
    ([25, 25, 10, 40], torch.float32, "fc2.weight"),
    ([7], torch.float64, "fc1.bias"),
    ([3, 13], torch.bfloat16, "fc1.weight"),
]


@exercise("ex-2-combine", function="my_combine", timeout=20)
def combine_gradients(fn: Callable) -> str:
    """``fn(shard_grads, shard_sizes)`` against the gradient of the whole batch's mean loss, for
    equal and uneven shards of the MLP's data, 1-D and 2-D gradients in float64, float32 and
    bfloat16; the result must keep the gradients' dtype and shape, and the shards' gradients
    and sizes must come back untouched."""
    for sizes, dtype, name in COMBINE_CASES:
        parts, whole = _shard_gradients(sizes, dtype, name)
        what = (f"shards of sizes {sizes}, the gradient of {name} "
                f"({tuple(whole.shape)}, {str(dtype).removeprefix('torch.')})")
        with about(what):
            got = call_learner_untouched(fn, ["shard_grads", "shard_sizes"], parts, list(sizes))
            expect_type(got, torch.Tensor, "your result")
        if got.shape == whole.shape and got.dtype == whole.dtype:
            n = len(sizes)
            plain = sum(p.double() for p in parts) / n
            if n > 1 and torch.allclose(got.double(), sum(p.double() for p in parts), rtol=1e-2):
                raise Mismatch(
                    f"{what}: you returned the sum of the shards' gradients, "
                    f"{n} times too large. Each is the gradient of a mean loss: weigh them."
                )
            if len(set(sizes)) > 1 and torch.allclose(got.double(), plain, rtol=1e-3):
                raise Mismatch(
                    f"{what}: you returned the plain mean of the shards' "
                    f"gradients, which weighs the shard of {min(sizes)} as much as the shard of "
                    f"{max(sizes)}. Weigh shard i by its share of the batch, B_i / B."
                )
        if got.dtype != whole.dtype:
            raise Mismatch(f"{what}: your result is {got.dtype}, the gradients are {whole.dtype}: "
                           "a parameter's .grad must have its dtype. Weigh with Python numbers "
                           "(size / total * g), which keep the tensor's dtype, or convert back")
        exact = dtype == torch.float64
        expect_close(got, whole, what, rtol=1e-9 if exact else None,
                     atol=1e-12 if exact else None)
    return ("equal to the whole batch's gradient for equal and uneven shards, 1-D and 2-D, in "
            "float64, float32 and bfloat16, inputs untouched")


# A replica waits this long at the barrier for the others before deciding it ran alone.
BARRIER_TIMEOUT = 3.0


class _Replica(nn.Module):
    """A linear layer that notes what its forward saw: whether the other replicas were running
    at the same time (a barrier they all wait at) and whether grad mode was on. Replica ``i`` then
    sleeps longer the smaller ``i``, so that in threads replica 0 finishes last."""

    def __init__(self, index: int, shared: dict, fail: bool = False) -> None:
        super().__init__()
        self.index, self.shared, self.fail = index, shared, fail
        self.linear = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.fail:
            raise ValueError(f"replica {self.index} cannot run (raised on purpose by the check)")
        self.shared["grad mode"][self.index] = torch.is_grad_enabled()
        barrier = self.shared.get("barrier")
        if barrier is not None:
            try:
                barrier.wait(BARRIER_TIMEOUT)
            except threading.BrokenBarrierError:
                self.shared["alone"].add(self.index)
            time.sleep(0.05 * (barrier.parties - 1 - self.index))
        return self.linear(x) if scale is None else self.linear(x) * scale


def _replicas(n: int, fail: int | None = None,
              two_inputs: bool = False) -> tuple[list[_Replica], list[tuple], dict]:
    """``n`` replicas and their inputs: one tensor each, or with ``two_inputs`` two (``inputs[i]``
    is then ``(x_i, scale_i)``, as scatter gives a forward that takes two tensors)."""
    torch.manual_seed(n)
    shared: dict = {"grad mode": {}, "alone": set()}
    devices = replication.devices_for(n)
    replicas = [_Replica(i, shared, fail=i == fail).to(d) for i, d in enumerate(devices)]
    batch = (torch.randn(3 * n + 1, 5),) + ((torch.rand(3 * n + 1, 2) + 0.5,) if two_inputs
                                            else ())
    inputs = scatter_gather.scatter(batch, devices)
    return replicas, inputs, shared


def _forbidden(*args, **kwargs):
    raise Mismatch("you called a ready-made parallel_apply (the package's or torch's): start "
                   "the threads yourself, with threading.Thread")


@contextlib.contextmanager
def _no_ready_made_parallel_apply() -> Iterator[None]:
    owners = [replication, scatter_gather, torch_parallel]
    saved = [(m, m.parallel_apply) for m in owners]
    try:
        for m in owners:
            m.parallel_apply = _forbidden
        yield
    finally:
        for m, fn in saved:
            m.parallel_apply = fn


def _expect_outputs(got, replicas, inputs, grad: bool, what: str) -> None:
    n = len(replicas)
    with torch.no_grad():
        want = [r.linear(x[0]) * (x[1] if len(x) > 1 else 1)
                for r, x in zip(replicas, inputs, strict=True)]
    if not isinstance(got, list | tuple) or len(got) != n:
        raise Mismatch(f"{what}: expected a list of {n} outputs, one per replica, got "
                       f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, list | tuple)
                                                  else ""))
    for i, out in enumerate(got):
        if not isinstance(out, torch.Tensor):
            raise Mismatch(f"{what}: output {i} is {out!r}, not a tensor (did replica {i}'s "
                           "thread store its result?)")
    for i, out in enumerate(got):
        if out.shape == want[i].shape and torch.allclose(out.detach(), want[i]):
            continue
        j = next((j for j, w in enumerate(want)
                  if out.shape == w.shape and torch.allclose(out.detach(), w)), None)
        if j is not None:
            raise Mismatch(f"{what}: output {i} is replica {j}'s output. Put each result in its "
                           "replica's place (results[i] = ...), not in the order the threads "
                           "finish: gather concatenates them in device order, the order of the "
                           "targets.")
        hint = ""
        if len(inputs[i]) > 1 and out.shape == want[i].shape and torch.allclose(
                out.detach(), replicas[i].linear(inputs[i][0]).detach()):
            hint = (f": it is replica {i}'s output on inputs[{i}][0] alone. inputs[i] is a tuple "
                    f"of the forward's arguments: call replicas[i](*inputs[i])")
        if hint:
            raise Mismatch(f"{what}: output {i}{hint}")
        expect_close(out.detach(), want[i], f"{what}: output {i}")
    if grad and not all(out.requires_grad for out in got):
        raise Mismatch(f"{what}: the outputs do not require grad, so backward could not reach "
                       "the replicas: run the forwards with gradients on when the caller has "
                       "them on")
    if not grad and any(out.requires_grad for out in got):
        raise Mismatch(f"{what}: your replicas ran with gradients on, although the caller "
                       "turned them off. Grad mode is a per-thread setting, and a new thread "
                       "starts with it on: read torch.is_grad_enabled() in the caller and wrap "
                       "each thread's forward in torch.set_grad_enabled(...) (nn.DataParallel "
                       "does).")


def _raises_what_a_replica_raised(fn: Callable) -> None:
    replicas, inputs, _ = _replicas(3, fail=1)
    uncaught: list = []
    previous = threading.excepthook
    threading.excepthook = uncaught.append  # a thread's uncaught error, kept off the output
    try:
        with _no_ready_made_parallel_apply():
            got = fn(replicas, inputs)
    except NotImplementedError as exc:
        raise NotAttempted(str(exc) or "the function is not written yet") from exc
    except Exception as exc:
        chain, seen = exc, set()
        while chain is not None and id(chain) not in seen:
            seen.add(id(chain))
            if isinstance(chain, ValueError) and "raised on purpose" in str(chain):
                return
            # the chain a traceback shows ("raise ... from None" hides the context)
            hidden = chain.__suppress_context__
            chain = chain.__cause__ or (None if hidden else chain.__context__)
        if "raised on purpose" in str(exc):
            return
        raise Mismatch(f"replica 1 raised ValueError in its forward; your function then raised "
                       f"{type(exc).__name__}: {exc}, which does not say so. Raise the "
                       "replica's own error (or one made from it) after join().") from None
    finally:
        threading.excepthook = previous
    lost = " in its thread, which died with it" if uncaught else ""
    raise Mismatch(f"replica 1 raised ValueError{lost}, and your function returned "
                   f"{type(got).__name__} instead of raising. An exception in a thread does not "
                   "reach the thread that started it: catch it in the thread, keep it, and raise "
                   "it after join().")


@exercise("ex-2-threads", function="my_parallel_apply", timeout=60)
def parallel_apply(fn: Callable) -> str:
    """``fn(replicas, inputs)`` runs ``replicas[i](*inputs[i])`` for every ``i``, each forward in
    a thread of its own, as ``nn.DataParallel``'s parallel-apply does; rejects forwards run one
    after another, outputs in the order the threads finish, the caller's grad mode lost in the
    threads, and an exception lost in a thread."""
    for n, grad, two in [(4, True, False), (3, False, False), (2, True, True)]:
        replicas, inputs, shared = _replicas(n, two_inputs=two)
        shared["barrier"] = threading.Barrier(n)
        what = (f"{n} replicas" + ("" if grad else " under torch.no_grad()")
                + (" whose forward takes two tensors, inputs[i] = (x_i, scale_i)" if two else ""))
        with _no_ready_made_parallel_apply(), torch.set_grad_enabled(grad):
            got = call_learner(fn, replicas, inputs)
        if sorted(shared["grad mode"]) != list(range(n)):
            missing = sorted(set(range(n)) - set(shared["grad mode"]))
            raise Mismatch(f"{what}: replicas {missing} never ran their forward")
        if shared["alone"]:
            raise Mismatch(f"{what}: the replicas' forwards ran one after another (replica "
                           f"{min(shared['alone'])} waited {BARRIER_TIMEOUT:g} s for the others "
                           "to be running). Start one threading.Thread per replica, then join "
                           "them all.")
        _expect_outputs(got, replicas, inputs, grad, what)
    _raises_what_a_replica_raised(fn)
    return ("the forwards run at the same time, in threads, with the caller's grad mode; "
            "outputs in replica order; a replica's error is raised")
