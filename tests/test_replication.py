"""Tests for dpcourse.replicas.replication: manual data parallelism equals one device and
nn.DataParallel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpcourse import runtime
from dpcourse.one_device import data, models, training
from dpcourse.replicas import replication, scatter_gather

mse = nn.functional.mse_loss


def _regression(dtype=torch.float64, n=100):
    x, y = data.random_regression(num_samples=n).tensors
    return x.to(dtype), y.to(dtype)


def _mlp(dtype=torch.float64, seed=0, **kwargs):
    torch.manual_seed(seed)
    return models.MLP(**kwargs).to(dtype)


class FrozenAndBuffers(nn.Module):
    """An MLP whose first layer is frozen and which scales its input by a buffer."""

    def __init__(self):
        super().__init__()
        self.mlp = models.MLP()
        self.mlp.fc1.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.mlp(x * self.scale)


def _single_device_run(model, batches, make_opt, loss_fn=mse):
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _manual_run(model, batches, n, make_opt, devices=None, threads=True, loss_fn=mse):
    master = copy.deepcopy(model)
    replicas = replication.create_replicas(master, devices or replication.devices_for(n))
    opt = make_opt(master.parameters())
    losses = [
        replication.data_parallel_step(master, replicas, b, loss_fn, opt, threads=threads)
        for b in batches
    ]
    return master, losses


def _batches(x, y, sizes):
    out, start = [], 0
    for s in sizes:
        out.append((x[start : start + s], y[start : start + s]))
        start += s
    return out


# ------------------------------------------------------------------------------- devices
def test_devices_for_uses_the_runtime():
    for n in (1, 3, 8):
        devices = replication.devices_for(n)
        assert len(devices) == n
        assert devices == [
            runtime.device_for_rank(i, n, runtime.choose_backend(n)) for i in range(n)
        ]
    if runtime.gpu_count() == 0:
        assert replication.devices_for(4) == [torch.device("cpu")] * 4
    with pytest.raises(ValueError, match="at least one"):
        replication.devices_for(0)


def test_module_device_and_its_errors():
    assert replication.module_device(models.MLP()) == torch.device("cpu")
    mixed = models.MLP()
    mixed.fc3.to("meta")  # a second device that every machine has
    with pytest.raises(ValueError, match="several devices.*cpu, meta.*to\\(device\\)"):
        replication.module_device(mixed)
    with pytest.raises(ValueError, match="no parameters or buffers"):
        replication.module_device(nn.ReLU())


# ------------------------------------------------------------------------ copies of models
def test_device_copy_is_an_independent_equal_copy():
    model = FrozenAndBuffers()
    model(torch.randn(3, 5)).sum().backward()  # the original has gradients
    replica = replication.device_copy(model, "cpu")
    assert replication.max_difference(model, replica) == 0.0
    assert torch.equal(replica.scale, model.scale)
    assert all(p.grad is None for p in replica.parameters())
    flags = [p.requires_grad for p in model.parameters()]
    assert [p.requires_grad for p in replica.parameters()] == flags
    for p, q in zip(model.parameters(), replica.parameters(), strict=True):
        assert p.data_ptr() != q.data_ptr()
    with torch.no_grad():
        next(replica.parameters()).add_(1.0)
    assert replication.max_difference(model, replica) == pytest.approx(1.0)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_create_replicas_are_identical_and_independent(n):
    model = _mlp(torch.float32)
    replicas = replication.create_replicas(model, replication.devices_for(n))
    assert len(replicas) == n
    assert all(replica is not model for replica in replicas)
    for replica in replicas:
        assert replication.max_difference(model, replica) == 0.0
    pointers = {p.data_ptr() for r in replicas for p in r.parameters()}
    assert len(pointers) == n * len(list(model.parameters()))


def test_create_replicas_errors():
    with pytest.raises(ValueError, match="at least one device"):
        replication.create_replicas(models.MLP(), [])
    mixed = models.MLP()
    mixed.fc1.to("meta")
    with pytest.raises(ValueError, match="several devices"):
        replication.create_replicas(mixed, ["cpu", "cpu"])


def test_replica_devices_refuses_mixed_and_mismatched_replicas():
    replicas = replication.create_replicas(models.MLP(), ["cpu", "cpu", "cpu"])
    assert replication.replica_devices(replicas) == [torch.device("cpu")] * 3
    replicas[2].fc2.to("meta")
    with pytest.raises(ValueError, match="replica 2: .*several devices"):
        replication.replica_devices(replicas)
    other = replication.create_replicas(models.MLP(hidden=16), ["cpu"])
    with pytest.raises(ValueError, match="replica 1 does not have the master's parameters"):
        replication.replica_devices([replicas[0], other[0]])
    with pytest.raises(ValueError, match="at least one replica"):
        replication.replica_devices([])


# -------------------------------------------------------------------------------- chunking
@pytest.mark.parametrize("n", range(1, 9))
def test_chunk_data_is_torch_chunk(n):
    for size in range(n, 41):
        batch = torch.arange(size)
        got = scatter_gather.chunk_data(batch, n)
        want = torch.chunk(batch, n)
        assert [c.tolist() for c in got] == [c.tolist() for c in want]
        assert 1 <= len(got) <= n


def test_chunk_data_sizes_of_the_tutorial_experiment():
    sizes = {n: [len(c) for c in scatter_gather.chunk_data(torch.zeros(30, 5), n)]
             for n in (1, 2, 3, 8)}
    assert sizes == {1: [30], 2: [15, 15], 3: [10, 10, 10], 8: [4] * 7 + [2]}
    # torch.chunk's rule can leave devices idle: 9 samples on 8 devices use 5 of them.
    assert [len(c) for c in scatter_gather.chunk_data(torch.zeros(9), 8)] == [2, 2, 2, 2, 1]


def test_chunk_data_of_a_tuple_keeps_samples_together():
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    chunks = scatter_gather.chunk_data((x, y), 3)
    assert [len(cx) for cx, _ in chunks] == [4, 4, 2]
    for cx, cy in chunks:
        assert torch.equal(cx[:, 0].long(), cy)


def test_chunk_data_errors():
    with pytest.raises(ValueError, match="the batch is empty"):
        scatter_gather.chunk_data(torch.zeros(0, 5), 2)
    with pytest.raises(ValueError, match="batch of 3 sample.*between 4 replicas.*at least 4"):
        scatter_gather.chunk_data(torch.zeros(3, 5), 4)
    with pytest.raises(ValueError, match="positive integer"):
        scatter_gather.chunk_data(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="same first dimension"):
        scatter_gather.chunk_data((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(ValueError, match="0-dimensional"):
        scatter_gather.chunk_data(torch.tensor(1.0), 1)
    with pytest.raises(TypeError, match="tensor or a tuple"):
        scatter_gather.chunk_data([[1, 2]], 1)


# ---------------------------------------------------------- scatter, apply, gather
def test_scatter_parallel_apply_gather_equal_one_forward():
    model = _mlp()
    x, _ = _regression()
    for n in range(1, 6):
        devices = replication.devices_for(n)
        replicas = replication.create_replicas(model, devices)
        inputs = scatter_gather.scatter(x[:37], devices)
        assert all(isinstance(i, tuple) and i[0].device == d
                   for i, d in zip(inputs, devices, strict=False))
        for threads in (True, False):
            outputs = scatter_gather.parallel_apply(replicas, inputs, threads=threads)
            out = scatter_gather.gather(outputs, devices[0])
            # float64: a GPU's kernels round otherwise than the CPU's, by about 1e-16
            torch.testing.assert_close(out.cpu(), model(x[:37]), rtol=1e-12, atol=1e-12)


def test_parallel_apply_keeps_grad_mode_and_names_a_failing_replica():
    replicas = replication.create_replicas(models.MLP(), ["cpu", "cpu"])
    inputs = [(torch.randn(2, 5),), (torch.randn(2, 5),)]
    with torch.no_grad():
        outs = scatter_gather.parallel_apply(replicas, inputs)
    assert not any(o.requires_grad for o in outs)
    assert all(o.requires_grad for o in scatter_gather.parallel_apply(replicas, inputs))
    with pytest.raises(RuntimeError, match="replica 1 failed"):
        scatter_gather.parallel_apply(replicas, [(torch.randn(2, 5),), (torch.randn(2, 4),)])
    with pytest.raises(ValueError, match="3 inputs but only 2 replicas"):
        scatter_gather.parallel_apply(replicas, inputs + inputs[:1])


def test_gather_backward_sends_each_replica_its_rows():
    parts = [torch.randn(3, 2, requires_grad=True), torch.randn(2, 2, requires_grad=True)]
    out = scatter_gather.gather(parts, "cpu")
    (out * torch.arange(10.0).reshape(5, 2)).sum().backward()
    assert torch.equal(parts[0].grad, torch.arange(6.0).reshape(3, 2))
    assert torch.equal(parts[1].grad, torch.arange(6.0, 10.0).reshape(2, 2))
    with pytest.raises(ValueError, match="no outputs"):
        scatter_gather.gather([], "cpu")


# ------------------------------------------------------------ broadcast and reduce
def test_broadcast_parameters_and_reduce_gradients():
    master = FrozenAndBuffers()
    replicas = replication.create_replicas(master, ["cpu"] * 3)
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(2)
        master.scale.add_(1)
    replication.broadcast_parameters(master, replicas)
    for r in replicas:
        assert replication.max_difference(master, r) == 0.0
        assert torch.equal(r.scale, master.scale)
    for i, r in enumerate(replicas):
        r(torch.full((2, 5), float(i + 1))).sum().backward()
    replication.reduce_gradients(replicas, master)
    assert master.mlp.fc1.weight.grad is None  # frozen
    want = sum(r.mlp.fc3.weight.grad for r in replicas)
    torch.testing.assert_close(master.mlp.fc3.weight.grad, want)
    with pytest.raises(ValueError, match="replica 0 does not have the master's parameters"):
        replication.broadcast_parameters(models.MLP(hidden=8), replicas[:1])


# --------------------------------------------------- one step: equal to one device
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_data_parallel_step_equals_one_device_over_several_steps(n):
    x, y = _regression()
    model = _mlp()
    batches = _batches(x, y, [37, 23, 30, 10])  # sizes that n does not divide
    adam = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    ref, ref_losses = _single_device_run(model, batches, adam)
    master, losses = _manual_run(model, batches, n, adam)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=1e-12)
    assert replication.max_difference(master, ref) < 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_data_parallel_step_equals_nn_data_parallel(n):
    # On a machine without GPUs nn.DataParallel runs the module as it is; with GPUs it
    # replicates it over them. Either way the manual step must agree with it.
    x, y = _regression()
    model = _mlp()
    gpus = runtime.gpu_count()
    devices = list(range(min(n, gpus))) if gpus else None
    dp_model = copy.deepcopy(model).to(replication.devices_for(1)[0])
    dp = nn.DataParallel(dp_model, device_ids=devices)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    master, losses = _manual_run(model, _batches(x, y, [31, 29, 40]), n,
                                 lambda p: torch.optim.SGD(p, lr=0.1))
    dp_losses = []
    for bx, by in _batches(x, y, [31, 29, 40]):
        out = dp(bx.to(dp_model.fc1.weight.device))
        loss = mse(out, by.to(out.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        dp_losses.append(loss.item())
    # float64: rounding alone separates them (a GPU may sum in another order than the CPU)
    torch.testing.assert_close(losses, dp_losses, rtol=1e-10, atol=1e-10)
    assert replication.max_difference(master, dp.module) < 1e-10


def test_float32_agrees_within_rounding():
    x, y = _regression(torch.float32)
    model = _mlp(torch.float32)
    batches = _batches(x, y, [37, 23, 40])
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    ref, ref_losses = _single_device_run(model, batches, sgd)
    master, losses = _manual_run(model, batches, 3, sgd)
    torch.testing.assert_close(losses, ref_losses)  # float32 defaults: rtol 1.3e-6
    assert replication.max_difference(master, ref) < 1e-5


def test_train_data_parallel_equals_training_train():
    x, y = _regression()
    model = _mlp()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=30,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    master, losses = replication.train_data_parallel(model, loader, replication.devices_for(3),
                                                     mse, adam)
    loader.generator.manual_seed(0)
    ref = copy.deepcopy(model)
    history = training.train(ref, loader, adam(ref.parameters()), mse, progress=False)
    assert len(losses) == history.steps == 4
    torch.testing.assert_close(losses, history.step_losses, rtol=1e-12, atol=1e-12)
    assert replication.max_difference(master, ref) < 1e-12
    assert replication.max_difference(model, _mlp()) == 0.0  # the model itself is unchanged


def test_fewer_chunks_than_replicas_uses_the_first_ones():
    x, y = _regression()
    model = _mlp()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    ref, _ = _single_device_run(model, [(x[:9], y[:9])], sgd)
    master, _ = _manual_run(model, [(x[:9], y[:9])], 8, sgd)  # 5 chunks for 8 replicas
    assert replication.max_difference(master, ref) < 1e-12


def test_frozen_parameters_and_buffers():
    torch.manual_seed(0)
    model = FrozenAndBuffers().double()
    x, y = _regression()
    frozen = model.mlp.fc1.weight.detach().clone()
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    batches = _batches(x, y, [33, 33, 34])
    ref, ref_losses = _single_device_run(model, batches, adam)
    master, losses = _manual_run(model, batches, 4, adam)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=1e-12)
    assert replication.max_difference(master, ref) < 1e-12
    assert torch.equal(master.mlp.fc1.weight, frozen)
    assert master.mlp.fc1.weight.grad is None


def test_batchnorm_running_statistics_come_from_replica_0():
    torch.manual_seed(0)
    model = models.ConvNetBN()
    x, y = data.random_images(24).tensors
    master = copy.deepcopy(model)
    replicas = replication.create_replicas(master, ["cpu"] * 3)
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    replication.data_parallel_step(master, replicas, (x, y), nn.functional.cross_entropy, opt)
    alone = copy.deepcopy(model)
    alone(x[:8])  # replica 0's chunk: what nn.DataParallel's module keeps
    for ours, theirs in zip(master.buffers(), alone.buffers(), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_data_parallel_step_errors():
    master = models.MLP()
    replicas = replication.create_replicas(master, ["cpu", "cpu"])
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    x, y = torch.randn(1, 5), torch.randn(1, 2)
    with pytest.raises(ValueError, match="batch of 1 sample.*between 2 replicas"):
        replication.data_parallel_step(master, replicas, (x, y), mse, opt)
    with pytest.raises(ValueError, match="the batch is empty"):
        replication.data_parallel_step(master, replicas, (x[:0], y[:0]), mse, opt)
    with pytest.raises(ValueError, match="target only"):
        replication.data_parallel_step(master, replicas, (y,), mse, opt)
    replicas[1].fc1.to("meta")
    with pytest.raises(ValueError, match="replica 1: .*several devices"):
        replication.data_parallel_step(master, replicas, (x, y), mse, opt)


# ------------------------------------------------------------------------- inspection
def test_gradients_of_the_batch_are_the_weighted_gradients_of_its_shards():
    model = _mlp()
    x, y = _regression()
    whole = replication.gradients(model, (x, y), mse)
    assert all(p.grad is None for p in model.parameters())  # .grad left alone
    shards = [(x[:60], y[:60]), (x[60:], y[60:])]
    parts = [replication.gradients(model, s, mse) for s in shards]
    for name, g in whole.items():
        torch.testing.assert_close(g, 0.6 * parts[0][name] + 0.4 * parts[1][name])
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        replication.gradients(frozen, (x, y), mse)


def test_max_difference():
    a, b = models.MLP(), models.MLP()
    assert replication.max_difference(a, a) == 0.0
    assert replication.max_difference(a, b) > 0
    assert replication.max_difference({"w": torch.ones(2)}, {"w": torch.zeros(2)}) == 1.0
    with pytest.raises(ValueError, match="different names"):
        replication.max_difference({"w": torch.ones(2)}, {"v": torch.ones(2)})


# ------------------------------------------------------------------------------- GPUs
@pytest.mark.gpu
def test_replicas_sharing_one_gpu_equal_the_cpu():
    x, y = _regression()
    model = _mlp()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    ref, _ = _single_device_run(model, _batches(x, y, [37, 23]), sgd)
    gpu = runtime.device_for_rank(0, 1, "gloo")
    master, _ = _manual_run(model, _batches(x, y, [37, 23]), 3, sgd, devices=[gpu] * 3)
    assert replication.max_difference(master, ref) < 1e-10


@pytest.mark.gpu
def test_a_gpu_and_the_cpu_mixed_equal_the_cpu():
    x, y = _regression()
    model = _mlp()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    ref, _ = _single_device_run(model, _batches(x, y, [37, 23]), sgd)
    mixed = [runtime.device_for_rank(0, 1, "gloo"), torch.device("cpu")]
    master, _ = _manual_run(model, _batches(x, y, [37, 23]), 2, sgd, devices=mixed)
    assert replication.max_difference(master, ref) < 1e-10


@pytest.mark.multigpu
@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_one_replica_per_gpu_equals_nn_data_parallel(n):
    if runtime.gpu_count() < n:
        pytest.skip(f"needs {n} GPUs, found {runtime.gpu_count()}")
    devices = replication.devices_for(n)
    assert [d.index for d in devices] == list(range(n))
    x, y = _regression()
    model = _mlp()
    master, losses = _manual_run(model, _batches(x, y, [37, 23]), n,
                                 lambda p: torch.optim.SGD(p, lr=0.1), devices=devices)
    dp = nn.DataParallel(copy.deepcopy(model).to(devices[0]), device_ids=devices)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    for i, (bx, by) in enumerate(_batches(x, y, [37, 23])):
        out = dp(bx.to(devices[0]))
        loss = mse(out, by.to(devices[0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(loss.item() - losses[i]) < 1e-10
    assert replication.max_difference(master, dp.module) < 1e-10
