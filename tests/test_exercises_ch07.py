"""Chapter 7's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from dpcourse.ddp import buckets, ddp, sampler
from dpcourse.harness.exercises import ch07, run_check
from dpcourse.harness.launch import RankPool


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(ch07, "RANK_TIMEOUT", 20.0)


@pytest.fixture(scope="module")
def pools():
    """The rank checks run on 2 and 3 ranks: keep those ranks between checks."""
    with RankPool(2), RankPool(3):
        yield


# --------------------------------------------------------------------------- buckets
def buckets_in_forward_order(sizes, cap):
    buckets, current, size = [], [], 0
    for i, s in enumerate(sizes):
        current.append(i)
        size += s
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


# closing a bucket before the parameter that would take it past the cap (none exceeds it)
buckets_that_close_early = ch07._closing_early


def one_bucket_each_but_forgets_the_last(sizes, cap):
    return [[i] for i in reversed(range(len(sizes)))][:-1]


def test_bucket_check():
    assert run_check("ex-7-buckets", buckets.bucket_assignment).passed
    result = run_check("ex-7-buckets", buckets_in_forward_order)
    assert not result.passed and "last parameter backwards" in result.message
    result = run_check("ex-7-buckets", buckets_that_close_early)
    assert not result.passed and "before a parameter that would take it past" in result.message
    result = run_check("ex-7-buckets", one_bucket_each_but_forgets_the_last)
    assert not result.passed and "exactly one bucket" in result.message


# --------------------------------------------------------------------------- the hook
def launch_reference(param, pending):
    param.grad.div_(dist.get_world_size())
    pending.append(dist.all_reduce(param.grad, async_op=True))


def divide_after_launching(param, pending):
    """Launch, then divide: on gloo the mean often comes out anyway, but it is a race."""
    pending.append(dist.all_reduce(param.grad, async_op=True))
    param.grad.div_(dist.get_world_size())


def launch_blocking(param, pending):
    param.grad.div_(dist.get_world_size())
    pending.append(dist.all_reduce(param.grad))  # returns None


def launch_sum(param, pending):
    pending.append(dist.all_reduce(param.grad, async_op=True))


def launch_and_forget(param, pending):
    param.grad.div_(dist.get_world_size())
    dist.all_reduce(param.grad, async_op=True).wait()


def test_hook_check(short_timeouts, pools):
    assert run_check("ex-7-hook", launch_reference).passed
    result = run_check("ex-7-hook", launch_blocking)
    assert not result.passed and "async_op=True" in result.message
    result = run_check("ex-7-hook", launch_sum)
    assert not result.passed and "sum of the ranks' gradients" in result.message
    result = run_check("ex-7-hook", launch_and_forget)  # waits, and appends nothing
    assert not result.passed and "waited on inside backward" in result.message
    result = run_check("ex-7-hook", divide_after_launching)
    assert not result.passed and "changed in place after their all-reduce" in result.message


# --------------------------------------------------------------------------- sampler
def sampler_reference(n, world, rank, epoch, seed):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed)
    s.set_epoch(epoch)
    return list(s)


def sampler_without_epoch(n, world, rank, epoch, seed):
    return sampler_reference(n, world, rank, 0, seed)


def sampler_contiguous(n, world, rank, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    size = -(-n // world)
    perm += (perm * world)[: size * world - n]
    return perm[rank * size : (rank + 1) * size]


def sampler_unpadded(n, world, rank, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return perm[rank::world]


def test_sampler_check():
    assert run_check("ex-7-sampler", sampler_reference).passed
    assert run_check("ex-7-sampler", lambda *a: sampler.epoch_indices(*a)).passed
    result = run_check("ex-7-sampler", sampler_without_epoch)
    assert not result.passed and "epoch 0's order again" in result.message
    result = run_check("ex-7-sampler", sampler_contiguous)
    assert not result.passed and "deals it out like cards" in result.message
    result = run_check("ex-7-sampler", sampler_unpadded)
    assert not result.passed and "padded by repeating" in result.message


# --------------------------------------------------------------------------- step 2
def average_sum(module):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_touching_frozen(module):
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)


def average_nothing(module):
    pass


def test_average_check(short_timeouts, pools):
    assert run_check("ex-7-average", ddp.all_reduce_gradients).passed
    result = run_check("ex-7-average", average_sum)
    assert not result.passed and "sum of the ranks' gradients" in result.message
    result = run_check("ex-7-average", average_touching_frozen)
    assert not result.passed and "frozen fc1.bias" in result.message
    result = run_check("ex-7-average", average_nothing)
    assert not result.passed and "did not change" in result.message


# --------------------------------------------------------------------------- bucketed DDP
# The notebook's solution of ex-7-bucketed-ddp, and wrong answers that change one method.
class MyBucketedDDP:
    """Averages the gradients of `module` over the ranks, in buckets of `bucket_cap_bytes`,
    each all-reduced asynchronously as soon as it is full, while backward goes on."""

    def __init__(self, module, bucket_cap_bytes):
        ddp.broadcast_parameters(module)  # step 1: every rank starts from rank 0's weights
        self.world_size = dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]
        sizes = [p.numel() * p.element_size() for p in params]
        # lists of parameters, the last registered first (exercise ex-7-buckets)
        self.buckets = [[params[i] for i in b]
                        for b in buckets.bucket_assignment(sizes, bucket_cap_bytes)]
        self.bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.arrived = [0] * len(self.buckets)  # gradients arrived in each bucket this step
        self.next_to_launch = 0  # buckets leave strictly in this order
        self.pending = []  # (bucket index, flat tensor, Work) of the launched all-reduces
        for p in params:
            p.register_post_accumulate_grad_hook(self.mark_ready)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate gradients on this rank."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def mark_ready(self, param):
        """The gradient hook: `param.grad` is complete. Launch every bucket that is now full
        and next in line."""
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): the gradient stays here and accumulates
        self.arrived[self.bucket_of[param]] += 1
        while (self.next_to_launch < len(self.buckets)
               and self.arrived[self.next_to_launch] == len(self.buckets[self.next_to_launch])):
            self.launch(self.next_to_launch)

    def launch(self, k):
        """Start bucket k's all-reduce: its gradients as one flat tensor, divided by N."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        self.pending.append((k, flat, dist.all_reduce(flat, async_op=True)))
        self.next_to_launch = k + 1

    def finish(self):
        """After the last backward of a step: launch the buckets still waiting, wait for all,
        write the means back into the gradients, and get ready for the next step."""
        while self.next_to_launch < len(self.buckets):
            self.launch(self.next_to_launch)  # held back by a parameter without a gradient
        for k, flat, work in self.pending:
            work.wait()
            numels = [p.numel() for p in self.buckets[k]]
            for p, mean in zip(self.buckets[k], flat.split(numels), strict=True):
                p.grad = mean.view_as(p)
        self.arrived = [0] * len(self.buckets)
        self.next_to_launch, self.pending = 0, []


def my_bucketed_ddp(module, bucket_cap_bytes):
    return MyBucketedDDP(module, bucket_cap_bytes)


class PackageDDP:
    """The package's own DDP behind the exercise's interface."""

    def __init__(self, module, cap):
        self.ddp = ddp.DDP(module, bucket_cap_mb=cap / buckets.MB)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish(self):
        self.ddp.finish_gradient_synchronization()


class NoOverlap(MyBucketedDDP):
    def mark_ready(self, param):
        pass  # everything waits for finish()


class SkipsUnused(MyBucketedDDP):
    def finish(self):
        for k in range(self.next_to_launch, len(self.buckets)):
            if self.arrived[k] == len(self.buckets[k]):
                self.launch(k)
        self.next_to_launch = len(self.buckets)
        super().finish()


class LaunchesAsTheyFill(MyBucketedDDP):
    def mark_ready(self, param):
        if not self.require_backward_grad_sync:
            return
        k = self.bucket_of[param]
        self.arrived[k] += 1
        if self.arrived[k] == len(self.buckets[k]):
            self.launch(k)

    def launch(self, k):
        super().launch(k)
        self.launched = getattr(self, "launched", set()) | {k}

    def finish(self):
        for k in range(len(self.buckets)):
            if k not in getattr(self, "launched", set()):
                super().launch(k)
        self.launched = set()
        self.next_to_launch = len(self.buckets)
        super().finish()


class SyncsInsideNoSync(MyBucketedDDP):
    def mark_ready(self, param):
        self.arrived[self.bucket_of[param]] += 1
        while (self.next_to_launch < len(self.buckets)
               and self.arrived[self.next_to_launch] == len(self.buckets[self.next_to_launch])):
            self.launch(self.next_to_launch)


class DividesEveryMicroStep(MyBucketedDDP):
    def mark_ready(self, param):
        param.grad.div_(self.world_size)  # before looking at no_sync: again in every micro-step
        super().mark_ready(param)

    def launch(self, k):
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending.append((k, flat, dist.all_reduce(flat, async_op=True)))
        self.next_to_launch = k + 1


class ZerosForUnused(MyBucketedDDP):
    """Sends zeros for a parameter whose hook did not fire in the last backward, even if
    no_sync() accumulated a gradient for it."""
    def mark_ready(self, param):
        if self.require_backward_grad_sync:
            self.fired = getattr(self, "fired", set()) | {param}
        super().mark_ready(param)

    def launch(self, k):
        fired = getattr(self, "fired", set())
        grads = [p.grad if p in fired else torch.zeros_like(p) for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        self.pending.append((k, flat, dist.all_reduce(flat, async_op=True)))
        self.next_to_launch = k + 1

    def finish(self):
        super().finish()
        self.fired = set()


class PerParameter(MyBucketedDDP):
    def launch(self, k):
        for p in self.buckets[k]:
            g = (torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) / self.world_size
            self.pending.append((None, (p, g), dist.all_reduce(g, async_op=True)))
        self.next_to_launch = k + 1

    def finish(self):
        while self.next_to_launch < len(self.buckets):
            self.launch(self.next_to_launch)
        for _, (p, g), work in self.pending:
            work.wait()
            p.grad = g.view_as(p)
        self.arrived = [0] * len(self.buckets)
        self.next_to_launch, self.pending = 0, []


class Blocking(MyBucketedDDP):
    def launch(self, k):
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        dist.all_reduce(flat)
        self.pending.append((k, flat, dist.barrier(async_op=True)))
        self.next_to_launch = k + 1


class WaitsInLaunch(MyBucketedDDP):
    """Launches asynchronously but waits at once, inside the hook: no overlap left."""

    def launch(self, k):
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        work = dist.all_reduce(flat, async_op=True)
        work.wait()
        self.pending.append((k, flat, work))
        self.next_to_launch = k + 1


class WaitsForThePreviousBucket(MyBucketedDDP):
    """Waits for bucket k - 1 in the hook before launching bucket k (one in flight at most)."""

    def launch(self, k):
        if self.pending:
            self.pending[-1][2].wait()
        super().launch(k)


class Sums(MyBucketedDDP):
    def launch(self, k):
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.pending.append((k, flat, dist.all_reduce(flat, async_op=True)))
        self.next_to_launch = k + 1


class NoWriteBack(MyBucketedDDP):
    def finish(self):
        while self.next_to_launch < len(self.buckets):
            self.launch(self.next_to_launch)
        for _, _, work in self.pending:
            work.wait()
        self.arrived = [0] * len(self.buckets)
        self.next_to_launch, self.pending = 0, []


def answer(cls):
    return lambda module, cap: cls(module, cap)


BUCKETED_DDP_WRONG = [
    (NoOverlap, "no all-reduce was launched while backward ran"),
    (SkipsUnused, "`extra` got no gradient on rank 1, so bucket 1 never filled"),
    (LaunchesAsTheyFill, "strictly in bucket order"),
    (SyncsInsideNoSync, "in a backward inside no_sync()"),
    (DividesEveryMicroStep, "divides the accumulated sum once"),
    (ZerosForUnused, "still sends what it accumulated"),
    (PerParameter, "one all-reduce per parameter"),
    (Blocking, "without async_op=True inside backward (in launch)"),
    (WaitsInLaunch, "bucket 0's all-reduce was waited on inside backward (in launch): waiting "
                    "there blocks backward until the communication is done, so nothing overlaps"),
    (WaitsForThePreviousBucket, "bucket 0's all-reduce was waited on inside backward (in "
                                "launch)"),
    (Sums, "sum of the ranks' gradients, not their mean"),
    (NoWriteBack, "still this rank's own gradient"),
]


def test_bucketed_ddp_check_passes_the_solution_and_the_package(short_timeouts, pools):
    """The notebook's solution, and the package's DDP, which waits in a callback it queues on
    the autograd engine (as torch's DDP does): after the gradients, so not a wait in backward.
    The message says what was compared, and that a None gradient counts as zeros."""
    result = run_check("ex-7-bucketed-ddp", my_bucketed_ddp)
    assert result.passed, result.message
    assert "every trainable parameter's .grad equals" in result.message
    assert "a None counting as zeros" in result.message
    result = run_check("ex-7-bucketed-ddp", PackageDDP)
    assert result.passed, result.message


@pytest.mark.parametrize(
    ("wrong", "says"), BUCKETED_DDP_WRONG, ids=[w.__name__ for w, _ in BUCKETED_DDP_WRONG]
)
def test_bucketed_ddp_check_rejects(wrong, says, short_timeouts, pools):
    result = run_check("ex-7-bucketed-ddp", answer(wrong))
    assert not result.passed and says in result.message, result.message


def test_bucketed_ddp_stub_is_not_attempted(short_timeouts, pools):
    """The student edition's class: its methods raise NotImplementedError inside backward."""
    from dpcourse.harness.exercises.core import not_attempted

    message = "Exercise ex-7-bucketed-ddp: write your solution here"

    class Stub(MyBucketedDDP):
        def mark_ready(self, param):
            raise NotImplementedError(message)

        def launch(self, k):
            raise NotImplementedError(message)

        def finish(self):
            raise NotImplementedError(message)

    result = run_check("ex-7-bucketed-ddp", answer(Stub))
    assert result == not_attempted("ex-7-bucketed-ddp", message)


def test_bucketed_ddp_check_names_a_rank_that_skipped_the_last_bucket():
    """A rank that ends its step one all-reduce short, the other launching the bucket of the
    parameters it did not use: the ranks stop there and the message says why, no hang."""
    launches = ch07._Launches(None, [["b.weight"], ["extra.bias", "extra.weight"]], [65, 182],
                              {"b.weight": 65, "extra.bias": 13, "extra.weight": 169}, None)
    launches.step = 0  # `extra` used on rank 0 only
    rows = [[launches.CALL, 0, 1, 182, 0, 0, 0, 0], [launches.END, 0, 1, 0, 0, 1, 0, 0]]
    message = launches._verdict(rows)
    assert "rank 1 ended the step after 1 all-reduce(s), while rank 0 launched another" in message
    assert "`extra` got no gradient on rank 1" in message


# ------------------------------------------------ the wrong answers students write (issue 43)
def buckets_reversing_the_sizes(sizes, cap):
    """Kind 2: right buckets, but the caller's list of sizes is reversed in place."""
    sizes.reverse()  # the last parameter first
    out, current, size = [], [], 0
    for j, s in enumerate(sizes):
        current.append(len(sizes) - 1 - j)
        size += s
        if size >= cap:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def test_buckets_leave_the_sizes_alone(rejects):
    rejects("ex-7-buckets", buckets_reversing_the_sizes, "changed its argument param_bytes")


def launch_and_wait(param, pending):
    """Kind 2: divides, launches asynchronously, appends the Work, and waits for it in the
    hook: the right means, and nothing overlaps."""
    param.grad.div_(dist.get_world_size())
    work = dist.all_reduce(param.grad, async_op=True)
    work.wait()
    pending.append(work)


def test_hook_rejects_a_wait_inside_backward(short_timeouts, pools, rejects):
    rejects("ex-7-hook", launch_and_wait, "waited on inside backward (in launch_and_wait)",
                "append its Work to `pending` and return")


def sampler_padding_once(n, world, rank, epoch, seed):
    """Kind 1, an edge size: pads with perm[:padding], too short when there are fewer samples
    than ranks (1 sample on 4 ranks needs it 3 times)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    size = -(-n // world)
    perm += perm[: size * world - n]
    return perm[rank::world]


def test_sampler_pads_with_fewer_samples_than_ranks(rejects):
    rejects("ex-7-sampler", sampler_padding_once, "1 samples, 4 ranks",
                "repeated more than once")


def average_on_the_host(module):
    """Kind 3: each gradient averaged in a copy on the CPU, given back as it is."""
    world = dist.get_world_size()
    for p in module.parameters():
        if p.requires_grad:
            grad = p.grad.detach().cpu() / world
            dist.all_reduce(grad)
            p.grad = grad


def test_average_keeps_the_gradients_on_the_device(short_timeouts, pools, rejects):
    rejects("ex-7-average", average_on_the_host, "on a machine with GPUs",
                "a gradient on the host was assigned to a parameter on the device")


class ZerosOnTheHost(MyBucketedDDP):
    """Kind 3: a parameter without a gradient sends torch.zeros(p.shape), made on the CPU."""

    def launch(self, k):
        grads = [torch.zeros(p.shape) if p.grad is None else p.grad for p in self.buckets[k]]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)
        self.pending.append((k, flat, dist.all_reduce(flat, async_op=True)))
        self.next_to_launch = k + 1


def test_bucketed_ddp_makes_zeros_where_the_gradients_are(short_timeouts, pools, rejects):
    rejects("ex-7-bucketed-ddp", answer(ZerosOnTheHost), "on a machine with GPUs",
                "cat() got host tensor")
