"""Tests for dpcourse.replicas.averaging: gradient averaging through a CPU master, uneven shards,
parameter averaging and BatchNorm statistics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpcourse.one_device import data, models
from dpcourse.replicas import averaging, replication, scatter_gather
from dpcourse.replicas.parameter_averaging import average_parameters, train_parameter_averaging
from dpcourse.replicas.replica_batchnorm import batchnorm_statistics

mse = nn.functional.mse_loss


def _setup(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = models.MLP().to(dtype)
    x, y = data.random_regression().tensors
    return model, x.to(dtype), y.to(dtype)


def _sgd(lr=0.1):
    return lambda params: torch.optim.SGD(params, lr=lr)


def _single_device(model, batches, make_opt, eval_batch):
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        with torch.no_grad():
            losses.append(mse(model(eval_batch[0]), eval_batch[1]).item())
    return model, losses


# ----------------------------------------------------------------------------- shards
def test_local_backward_gives_each_replica_its_shards_gradient():
    model, x, y = _setup()
    replicas = replication.create_replicas(model, replication.devices_for(3))
    shards = scatter_gather.chunk_data((x[:31], y[:31]), 3)
    losses = averaging.local_backward(replicas, shards, mse)
    for replica, shard, loss in zip(replicas, shards, losses, strict=True):
        want = replication.gradients(model, shard, mse)
        for name, p in replica.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), want[name])  # the replica's device
        assert loss == pytest.approx(mse(model(shard[0]), shard[1]).item())
    with pytest.raises(ValueError, match="2 shards for 3 replicas"):
        averaging.local_backward(replicas, shards[:2], mse)
    with pytest.raises(ValueError, match="a shard is empty"):
        averaging.local_backward(replicas[:1], [(x[:0], y[:0])], mse)


def test_shard_weights():
    assert averaging.shard_weights([25, 25, 10, 40]) == [0.25, 0.25, 0.1, 0.4]
    with pytest.raises(ValueError, match="positive"):
        averaging.shard_weights([3, 0])
    with pytest.raises(ValueError, match="positive"):
        averaging.shard_weights([])


def test_split_by_fractions():
    x, y = torch.arange(40.0), torch.arange(40)
    shards = averaging.split_by_fractions((x, y), [0.25, 0.25, 0.1, 0.4])
    assert [len(s[0]) for s in shards] == [10, 10, 4, 16]
    assert torch.equal(torch.cat([s[1] for s in shards]), y)  # every sample once, in order
    odd = averaging.split_by_fractions((torch.arange(37),), [0.25, 0.25, 0.1, 0.4])
    assert [len(s[0]) for s in odd] == [9, 9, 4, 15]
    assert sum(len(s[0]) for s in odd) == 37
    with pytest.raises(ValueError, match="add up to 1"):
        averaging.split_by_fractions((x,), [0.5, 0.6])
    with pytest.raises(ValueError, match="leaves a shard empty"):
        averaging.split_by_fractions((x[:5],), [0.9, 0.1 - 1e-12, 1e-12])


# ---------------------------------------------------------------- averaging gradients
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_mean_of_equal_shards_is_the_whole_batch_gradient(n):
    model, x, y = _setup()
    batch = (x[: 12 * n], y[: 12 * n])  # equal shards
    replicas = replication.create_replicas(model, replication.devices_for(n))
    averaging.local_backward(replicas, scatter_gather.chunk_data(batch, n), mse)
    averaging.average_gradients(replicas)
    whole = replication.gradients(model, batch, mse)
    for r in replicas:  # every replica got the average back
        for name, p in r.named_parameters():
            torch.testing.assert_close(p.grad.cpu(), whole[name], rtol=1e-12, atol=1e-12)


def test_uneven_shards_need_the_weighted_mean():
    model, x, y = _setup()
    batch = (x[:40], y[:40])
    whole = replication.gradients(model, batch, mse)
    shards = averaging.split_by_fractions(batch, [0.25, 0.25, 0.1, 0.4])
    sizes = [len(s[1]) for s in shards]
    replicas = replication.create_replicas(model, replication.devices_for(4))

    averaging.local_backward(replicas, shards, mse)
    averaging.average_gradients(replicas, weights=sizes)
    for name, p in replicas[0].named_parameters():
        torch.testing.assert_close(p.grad.cpu(), whole[name], rtol=1e-12, atol=1e-12)

    averaging.local_backward(replicas, shards, mse)
    averaging.average_gradients(replicas)  # the plain mean over-weights the small shard
    assert replication.max_difference(
        {n: p.grad for n, p in replicas[0].named_parameters()}, whole) > 1e-3


def test_sum_is_n_times_the_mean_and_counts_its_traffic():
    model, x, y = _setup(torch.float32)
    n = 4
    replicas = replication.create_replicas(model, replication.devices_for(n))
    shards = scatter_gather.chunk_data((x[:40], y[:40]), n)
    averaging.local_backward(replicas, shards, mse)
    averaging.average_gradients(replicas)
    mean = {k: p.grad.clone() for k, p in replicas[0].named_parameters()}
    averaging.local_backward(replicas, shards, mse)
    traffic = averaging.Traffic()
    averaging.average_gradients(replicas, op="sum", traffic=traffic)
    for k, p in replicas[0].named_parameters():
        torch.testing.assert_close(p.grad, n * mean[k])
    param_bytes = sum(p.nbytes for p in model.parameters())
    assert traffic.bytes_to_master == traffic.bytes_from_master == n * param_bytes
    assert traffic.total_bytes == 2 * n * param_bytes and traffic.seconds > 0


def test_average_gradients_skips_frozen_parameters_and_refuses_bad_input():
    model, x, y = _setup()
    model.fc1.requires_grad_(False)
    replicas = replication.create_replicas(model, ["cpu"] * 3)
    averaging.local_backward(replicas, scatter_gather.chunk_data((x, y), 3), mse)
    averaging.average_gradients(replicas)
    assert all(r.fc1.weight.grad is None for r in replicas)
    assert replication.max_difference(
        {n: p.grad for n, p in replicas[0].named_parameters() if p.requires_grad},
        {n: p.grad for n, p in replicas[2].named_parameters() if p.requires_grad}) == 0.0

    replicas[1].fc2.weight.grad = None
    with pytest.raises(ValueError, match=r"replica\(s\) \[1\] have no gradient for 'fc2.weight'"):
        averaging.average_gradients(replicas)
    with pytest.raises(ValueError, match="op must be"):
        averaging.average_gradients(replicas, op="max")
    with pytest.raises(ValueError, match="2 weights for 3 replicas"):
        averaging.average_gradients(replicas, weights=[1, 2])
    with pytest.raises(ValueError, match="weights go with op='mean'"):
        averaging.average_gradients(replicas, weights=[1, 2, 3], op="sum")
    replicas[2].fc3.to("meta")
    with pytest.raises(ValueError, match="replica 2: .*several devices"):
        averaging.average_gradients(replicas)


def test_measure_averaging_grows_linearly_in_bytes():
    model = models.MLP(hidden=64)
    param_bytes = sum(p.nbytes for p in model.parameters())
    for n in (1, 2, 5):
        t = averaging.measure_averaging(model, n, repeats=2)
        assert t.bytes_to_master == n * param_bytes
        assert t.bytes_from_master == n * param_bytes
        assert t.seconds > 0
    with pytest.raises(ValueError, match="repeats"):
        averaging.measure_averaging(model, 2, repeats=0)


# ----------------------------------------------------------------- training runs
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_gradient_averaging_equals_one_device_over_several_steps(n):
    model, x, y = _setup()
    batches = [(x[:37], y[:37]), (x[37:74], y[37:74]), (x[74:], y[74:])]  # 37, 37, 26
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    ref, ref_losses = _single_device(model, batches, adam, (x, y))
    run = averaging.train_gradient_averaging(model, batches, n, mse, adam, (x, y))
    assert run.steps == [0, 1, 2, 3]
    torch.testing.assert_close(run.losses[1:], ref_losses, rtol=1e-12, atol=1e-12)
    assert replication.max_difference(run.model, ref) < 1e-12


def test_uneven_fractions_weighted_match_and_plain_does_not():
    model, x, y = _setup()
    batches = [(x[:40], y[:40]), (x[40:80], y[40:80])]
    fractions = [0.25, 0.25, 0.1, 0.4]
    ref, _ = _single_device(model, batches, _sgd(), (x, y))
    weighted = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(), (x, y),
                                                  fractions=fractions)
    plain = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(), (x, y),
                                               fractions=fractions, weighting="equal")
    assert replication.max_difference(weighted.model, ref) < 1e-12
    assert replication.max_difference(plain.model, ref) > 1e-4
    with pytest.raises(ValueError, match="weighting"):
        averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(), (x, y),
                                           weighting="median")


def test_sum_with_lr_over_n_equals_mean_with_lr():
    model, x, y = _setup()
    batches = [(x[:40], y[:40]), (x[40:80], y[40:80])]
    mean = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(0.1), (x, y))
    summed = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(0.1 / 4), (x, y),
                                                op="sum")
    too_big = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(0.1), (x, y),
                                                 op="sum")
    assert replication.max_difference(mean.model, summed.model) < 1e-12
    assert replication.max_difference(mean.model, too_big.model) > 1e-3


# -------------------------------------------------------------- parameter averaging
def test_average_parameters_averages_floats_and_keeps_counters():
    torch.manual_seed(0)
    replicas = replication.create_replicas(models.ConvNetBN(), ["cpu"] * 3)
    x = data.random_images(12).tensors[0]
    for r, chunk in zip(replicas, scatter_gather.chunk_data(x, 3), strict=True):
        r(chunk)  # different running statistics on each replica
        with torch.no_grad():
            r.classifier.weight.add_(torch.randn_like(r.classifier.weight))
    want_w = torch.stack([r.classifier.weight for r in replicas]).mean(0)
    want_mean = torch.stack([r.features[1].running_mean for r in replicas]).mean(0)
    traffic = averaging.Traffic()
    average_parameters(replicas, traffic=traffic)
    for r in replicas:
        torch.testing.assert_close(r.classifier.weight, want_w)
        torch.testing.assert_close(r.features[1].running_mean, want_mean)
        assert r.features[1].num_batches_tracked.item() == 1
    assert traffic.bytes_to_master == 3 * sum(
        t.nbytes for t in list(replicas[0].parameters()) + list(replicas[0].buffers()))


def test_parameter_averaging_with_k_1_is_gradient_averaging_and_drifts_as_k_grows():
    model, x, y = _setup()
    batches = [(x, y)] * 24
    sync = averaging.train_gradient_averaging(model, batches, 4, mse, _sgd(0.05), (x, y))
    one = train_parameter_averaging(model, batches, 4, mse, _sgd(0.05), (x, y), k=1)
    assert one.steps == sync.steps
    torch.testing.assert_close(one.losses, sync.losses, rtol=1e-12, atol=1e-12)
    drift = []
    for k in (1, 4, 12):
        run = train_parameter_averaging(model, batches, 4, mse, _sgd(0.05), (x, y), k)
        assert run.steps == list(range(0, 25, k))
        drift.append(replication.max_difference(run.model, sync.model))
    assert drift[0] < 1e-12 < drift[1] < drift[2]
    with pytest.raises(ValueError, match="k \\(steps between averagings\\)"):
        train_parameter_averaging(model, batches, 4, mse, _sgd(), (x, y), k=0)


def test_parameter_averaging_records_the_last_step():
    model, x, y = _setup()
    run = train_parameter_averaging(model, [(x, y)] * 10, 2, mse, _sgd(), (x, y), k=4)
    assert run.steps == [0, 4, 8, 10]


# ------------------------------------------------------------------------ BatchNorm
def test_batchnorm_statistics_differ_between_replicas():
    torch.manual_seed(0)
    model = models.ConvNetBN().double()
    x = data.random_images(32).tensors[0].double()
    before = [b.clone() for b in model.buffers()]
    stats = batchnorm_statistics(model, x, 4)
    assert [s.layer for s in stats] == ["features.1", "features.5"]
    assert all(torch.equal(b, c) for b, c in zip(before, model.buffers(), strict=True))
    first = stats[0]
    assert first.replica_means.shape == (4, 8) and first.whole_mean.shape == (8,)
    # The first layer sees the convolution of the data itself: with equal chunks the mean of
    # the chunks' means is the whole batch's mean, and the whole variance is the mean of the
    # chunks' variances plus the variance of their means (the law of total variance).
    torch.testing.assert_close(first.replica_means.mean(0), first.whole_mean)
    total = first.replica_vars.mean(0) + first.replica_means.var(0, unbiased=False)
    torch.testing.assert_close(total, first.whole_var)
    assert (first.replica_vars - first.whole_var).abs().max() > 1e-3
    with pytest.raises(ValueError, match="no BatchNorm"):
        batchnorm_statistics(models.MLP(), torch.randn(8, 5), 2)
