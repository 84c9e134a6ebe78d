"""Tests for dpcourse.memory: estimates against measurements, will_it_fit, the ZeRO formula."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpcourse import data, memory, models

mse = nn.functional.mse_loss
MLP_PARAMS = (5 * 32 + 32) + (32 * 32 + 32) + (32 * 2 + 2)

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
}


def _mlp_batch(batch_size: int = 30):
    x, y = data.random_regression(num_samples=batch_size).tensors
    return x, y


def test_count_parameters():
    assert memory.count_parameters(models.MLP()) == MLP_PARAMS
    shared = nn.Sequential(nn.Linear(4, 4))
    shared.append(shared[0])  # the same layer twice counts once
    assert memory.count_parameters(shared) == 20
    frozen = models.MLP()
    frozen.fc1.requires_grad_(False)
    assert memory.count_parameters(frozen, trainable_only=True) == MLP_PARAMS - (5 * 32 + 32)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_estimate_equals_measurement_for_params_grads_and_state(name):
    torch.manual_seed(0)
    model = models.MLP()
    x, y = _mlp_batch()
    estimated = memory.estimate_training_memory(model, x, optimizer=name)
    measured = memory.measure_training_memory(model, (x, y), mse, OPTIMIZERS[name](
        model.parameters()))
    assert estimated.parameters == measured.parameters == 4 * MLP_PARAMS
    assert estimated.gradients == measured.gradients == 4 * MLP_PARAMS
    assert estimated.optimizer_state == measured.optimizer_state
    states = {"sgd": 0, "sgd_momentum": 1, "adam": 2}[name]
    steps = 6 * memory.ADAM_STEP_BYTES if name == "adam" else 0  # one per parameter tensor
    assert measured.optimizer_state == states * 4 * MLP_PARAMS + steps


@pytest.mark.parametrize("batch_size", [1, 30, 256])
def test_activation_estimate_is_close_for_the_mlp(batch_size):
    # The rule (inputs of layers with weights, plus the output) misses only the loss's copy of
    # the target, 2 of 73 values per sample: within 5%.
    torch.manual_seed(0)
    model = models.MLP()
    x, y = _mlp_batch(batch_size)
    estimated = memory.estimate_training_memory(model, x, "sgd")
    measured = memory.measure_training_memory(model, (x, y), mse, OPTIMIZERS["sgd"](
        model.parameters()))
    assert estimated.activations == 4 * batch_size * (5 + 32 + 32 + 2)
    assert measured.activations == 4 * batch_size * (5 + 32 + 32 + 2 + 2)
    assert abs(estimated.activations / measured.activations - 1) < 0.05


def test_measured_activations_grow_with_the_batch_and_exclude_parameters():
    torch.manual_seed(0)
    model = nn.Linear(10, 10)  # autograd saves the weight too, but it is not an activation
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    small = memory.measure_training_memory(model, (torch.randn(1, 10), torch.randn(1, 10)), mse,
                                           opt)
    large = memory.measure_training_memory(model, (torch.randn(4, 10), torch.randn(4, 10)), mse,
                                           opt)
    assert small.activations == 3 * 10 * 4  # input, output, target: 10 floats each
    assert large.activations == 4 * small.activations


def test_measure_does_not_train():
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    memory.measure_training_memory(model, _mlp_batch(), mse, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_transformer_estimate_on_meta_equals_cpu_and_undercounts():
    ds = data.DigitsToWords(16, 1, 6, seed=0)
    src, tgt_in, tgt_out = data.collate_seq2seq([ds[i] for i in range(16)])
    torch.manual_seed(0)
    model = models.TinyTransformer(max_len=8)
    on_cpu = memory.estimate_training_memory(model, (src, tgt_in))
    with torch.device("meta"):
        meta_model = models.TinyTransformer(max_len=8)
    on_meta = memory.estimate_training_memory(meta_model, (src.to("meta"), tgt_in.to("meta")))
    assert on_cpu.as_dict() == on_meta.as_dict()
    measured = memory.measure_training_memory(
        model, (src, tgt_in, tgt_out), models.sequence_cross_entropy,
        torch.optim.Adam(model.parameters()),
    )
    assert measured.parameters == on_cpu.parameters
    assert measured.optimizer_state == on_cpu.optimizer_state
    assert on_cpu.activations < measured.activations  # the rule misses attention's internals


def test_dtype_bytes_prices_floats_only():
    model = models.TinyTransformer(max_len=8)
    src = torch.randint(3, 13, (4, 5))
    full = memory.estimate_training_memory(model, (src, src), "sgd")
    half = memory.estimate_training_memory(model, (src, src), "sgd", dtype_bytes=2)
    assert half.parameters * 2 == full.parameters
    # the integer inputs of the embeddings keep their 8 bytes
    assert full.activations / 2 < half.activations < full.activations


def test_memory_breakdown_total_and_table():
    b = memory.MemoryBreakdown(2**20, 2**20, 2 * 2**20, 3 * 2**20)
    assert b.total == 7 * 2**20
    assert b.as_dict()["total"] == b.total
    assert "7.00 MiB" in b.table() and "optimizer state" in str(b)
    table = memory.format_table({"a": b, "b": b})
    assert table.splitlines()[0].split() == ["a", "b"] and "total" in table


def test_will_it_fit():
    gib = 2**30
    fits, need = memory.will_it_fit(1_300_000_000, 24 * gib)
    assert fits and need.total == 16 * 1_300_000_000
    assert need.optimizer_state == 8 * 1_300_000_000
    fits, need = memory.will_it_fit(7_000_000_000, 80 * gib)
    assert not fits and "does NOT fit" in need.note
    assert memory.will_it_fit(100, 1600)[0] and not memory.will_it_fit(100, 1599)[0]
    assert memory.will_it_fit(100, 800, optimizer="sgd")[0]
    assert not memory.will_it_fit(100, 1600, activation_bytes=1)[0]
    with pytest.raises(ValueError):
        memory.will_it_fit(100, 1600, optimizer="lion")
    with pytest.raises(ValueError):
        memory.will_it_fit(-1, 1600)


def test_zero_memory_per_rank_matches_the_paper():
    # ZeRO paper, figure 1: 7.5B parameters, 64 GPUs, k = 12.
    psi = 7_500_000_000
    assert memory.zero_memory_per_rank(psi, 64, 0) == 120_000_000_000
    assert memory.zero_memory_per_rank(psi, 64, 1) == 31_406_250_000
    assert memory.zero_memory_per_rank(psi, 64, 2) == 16_640_625_000
    assert memory.zero_memory_per_rank(psi, 64, 3) == 1_875_000_000


def test_zero_memory_per_rank_by_hand():
    assert [memory.zero_memory_per_rank(1000, 4, s) for s in range(4)] == [
        16000, 4000 + 3000, 2000 + 3500, 4000,
    ]
    assert [memory.zero_memory_per_rank(10, 3, s, k=0) for s in range(4)] == [40, 40, 27, 14]
    assert {memory.zero_memory_per_rank(999, 1, s) for s in range(4)} == {16 * 999}


@pytest.mark.parametrize("args", [(100, 4, 4), (100, 4, -1), (100, 0, 1), (-5, 2, 1)])
def test_zero_memory_per_rank_rejects_bad_input(args):
    with pytest.raises(ValueError):
        memory.zero_memory_per_rank(*args)


def test_saved_activations_by_op_adds_up_to_the_measurement():
    ds = data.DigitsToWords(16, 1, 6, seed=0)
    seq_batch = data.collate_seq2seq([ds[i] for i in range(16)])
    torch.manual_seed(0)
    for model, batch, loss_fn in [
        (models.MLP(), _mlp_batch(), mse),
        (models.TinyTransformer(max_len=8), seq_batch, models.sequence_cross_entropy),
    ]:
        *inputs, target = batch
        by_op = memory.saved_activations_by_op(loss_fn(model(*inputs), target), model)
        measured = memory.measure_training_memory(model, batch, loss_fn,
                                                  torch.optim.SGD(model.parameters(), lr=0.1))
        assert sum(by_op.values()) == measured.activations
        assert list(by_op.values()) == sorted(by_op.values(), reverse=True)
    mlp, (x, y) = models.MLP(), _mlp_batch()
    mlp_ops = memory.saved_activations_by_op(mse(mlp(x), y), mlp)
    assert "Addmm" in mlp_ops and "Relu" not in mlp_ops  # ReLU's output is fc2's saved input


def test_estimate_is_the_same_in_eval_mode_and_skips_frozen_parameters():
    src = torch.randint(3, 13, (4, 5))
    model = models.TinyTransformer(max_len=8)
    in_train = memory.estimate_training_memory(model, (src, src))
    model.eval()
    assert memory.estimate_training_memory(model, (src, src)) == in_train
    assert not model.training  # mode restored
    mlp = models.MLP()
    mlp.fc1.requires_grad_(False)
    frozen = memory.estimate_training_memory(mlp, torch.randn(2, 5), "sgd_momentum")
    trainable_bytes = 4 * (MLP_PARAMS - (5 * 32 + 32))
    assert frozen.parameters == 4 * MLP_PARAMS
    assert frozen.gradients == frozen.optimizer_state == trainable_bytes
