"""Tests for dpcourse.one_device.memory (estimates, measurements, will_it_fit) and
dpcourse.sharding.zero_memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpcourse.one_device import data, memory, memory_measurement, models
from dpcourse.sharding import zero_memory

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
    measured = memory_measurement.measure_training_memory(model, (x, y), mse, OPTIMIZERS[name](
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
    measured = memory_measurement.measure_training_memory(model, (x, y), mse, OPTIMIZERS["sgd"](
        model.parameters()))
    assert estimated.activations == 4 * batch_size * (5 + 32 + 32 + 2)
    assert measured.activations == 4 * batch_size * (5 + 32 + 32 + 2 + 2)
    assert abs(estimated.activations / measured.activations - 1) < 0.05


def test_measured_activations_grow_with_the_batch_and_exclude_parameters():
    torch.manual_seed(0)
    model = nn.Linear(10, 10)  # autograd saves the weight too, but it is not an activation
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    measure = memory_measurement.measure_training_memory
    small = measure(model, (torch.randn(1, 10), torch.randn(1, 10)), mse, opt)
    large = measure(model, (torch.randn(4, 10), torch.randn(4, 10)), mse, opt)
    assert small.activations == 3 * 10 * 4  # input, output, target: 10 floats each
    assert large.activations == 4 * small.activations


def test_measure_does_not_train():
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    memory_measurement.measure_training_memory(model, _mlp_batch(), mse, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_transformer_estimate_on_meta_equals_cpu_and_undercounts():
    src, tgt_in, tgt_out = data.digits_batch(16, seed=0, max_len=6)
    torch.manual_seed(0)
    model = models.TinyTransformer(max_len=8)
    on_cpu = memory.estimate_training_memory(model, (src, tgt_in))
    with torch.device("meta"):
        meta_model = models.TinyTransformer(max_len=8)
    on_meta = memory.estimate_training_memory(meta_model, (src.to("meta"), tgt_in.to("meta")))
    assert on_cpu.as_dict() == on_meta.as_dict()
    measured = memory_measurement.measure_training_memory(
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
    assert zero_memory.zero_memory_per_rank(psi, 64, 0) == 120_000_000_000
    assert zero_memory.zero_memory_per_rank(psi, 64, 1) == 31_406_250_000
    assert zero_memory.zero_memory_per_rank(psi, 64, 2) == 16_640_625_000
    assert zero_memory.zero_memory_per_rank(psi, 64, 3) == 1_875_000_000


def test_zero_memory_per_rank_by_hand():
    assert [zero_memory.zero_memory_per_rank(1000, 4, s) for s in range(4)] == [
        16000, 4000 + 3000, 2000 + 3500, 4000,
    ]
    assert [zero_memory.zero_memory_per_rank(10, 3, s, k=0) for s in range(4)] == [40, 40, 27, 14]
    assert {zero_memory.zero_memory_per_rank(999, 1, s) for s in range(4)} == {16 * 999}


@pytest.mark.parametrize("args", [(100, 4, 4), (100, 4, -1), (100, 0, 1), (-5, 2, 1)])
def test_zero_memory_per_rank_rejects_bad_input(args):
    with pytest.raises(ValueError):
        zero_memory.zero_memory_per_rank(*args)


def test_saved_activations_by_op_adds_up_to_the_measurement():
    seq_batch = data.digits_batch(16, seed=0, max_len=6)
    torch.manual_seed(0)
    for model, batch, loss_fn in [
        (models.MLP(), _mlp_batch(), mse),
        (models.TinyTransformer(max_len=8), seq_batch, models.sequence_cross_entropy),
    ]:
        *inputs, target = batch
        by_op = memory_measurement.saved_activations_by_op(loss_fn(model(*inputs), target), model)
        measured = memory_measurement.measure_training_memory(model, batch, loss_fn,
                                                  torch.optim.SGD(model.parameters(), lr=0.1))
        assert sum(by_op.values()) == measured.activations
        assert list(by_op.values()) == sorted(by_op.values(), reverse=True)
    mlp, (x, y) = models.MLP(), _mlp_batch()
    mlp_ops = memory_measurement.saved_activations_by_op(mse(mlp(x), y), mlp)
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


# ------------------------------------------------------------ chapter 9: per rank, ZeRO stages
# ZeRO's Table 1, figure for figure: tests/test_published_figures.py, with the other published
# figures the package reproduces.


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("psi", [0, 1, 999, 7_500_000_000, 70_000_000_001])
def test_memory_per_rank_mixed_adam_is_the_zero_formula(world, psi):
    for stage in range(4):
        parts = zero_memory.memory_per_rank(psi, world, stage, "mixed", "adam")
        formula = zero_memory.zero_memory_per_rank(psi, world, stage)
        assert formula <= parts.total <= formula + 2  # each sharded part rounds up on its own
        if psi % world == 0:
            assert parts.total == formula
        assert parts.activations == 0


def test_memory_per_rank_parts_and_dtype_mixes():
    psi, n = 1000, 4
    fp32 = zero_memory.memory_per_rank(psi, 1, 0, "fp32", "adam")
    # the same bookkeeping as chapter 1's will_it_fit (fp32 Adam: 4 + 4 + 8 bytes)
    plain = memory.will_it_fit(psi, 10**9)[1]
    assert (fp32.parameters, fp32.gradients, fp32.optimizer_state) == (
        plain.parameters, plain.gradients, plain.optimizer_state)
    mixed = [zero_memory.memory_per_rank(psi, n, s, "mixed", activation_bytes=7) for s in range(4)]
    assert [(m.parameters, m.gradients, m.optimizer_state) for m in mixed] == [
        (2000, 2000, 12000), (2000, 2000, 3000), (2000, 500, 3000), (500, 500, 3000)]
    assert all(m.activations == 7 for m in mixed)  # ZeRO does not shard activations
    assert zero_memory.PRECISIONS["mixed"].k() == 12 and zero_memory.PRECISIONS["fp32"].k() == 8
    assert zero_memory.PRECISIONS["mixed"].k("sgd_momentum") == 8
    bf16_sgd = zero_memory.memory_per_rank(psi, 1, 0, "bf16", "sgd")
    assert bf16_sgd.total == 4 * psi
    custom = zero_memory.Precision("fp8 weights", 1, 2, 4, 4)
    assert zero_memory.memory_per_rank(psi, 2, 1, custom).total == 1000 + 2000 + 12000 // 2
    with pytest.raises(ValueError, match="precision must be one of"):
        zero_memory.memory_per_rank(psi, 2, 1, "fp64")
    for bad in [(psi, 0, 1), (psi, 2, 4), (-1, 2, 1)]:
        with pytest.raises(ValueError):
            zero_memory.memory_per_rank(*bad)


def test_will_it_fit_sharded_for_well_known_models():
    gib = 2**30
    # Llama-2 7B with mixed-precision Adam: 112 GB on one GPU, not even an 80 GB one ...
    assert not zero_memory.will_it_fit_sharded(7_000_000_000, 80 * gib, 1, 0)[0]
    # ... but 8 GPUs of 24 GB at stage 3 (14 GB each), or 8 of 40 GB at stage 1 (38.5 GB)
    assert zero_memory.will_it_fit_sharded(7_000_000_000, 24 * gib, 8, 3)[0]
    fits, need = zero_memory.will_it_fit_sharded(7_000_000_000, 40 * gib, 8, 1)
    assert fits and need.total == 4 * 7 * 10**9 + 12 * 7 * 10**9 // 8 and "fits" in need.note
    # GPT-2 1.5B: 24e9 bytes of states fit in 24 GiB (25.8e9) with little to spare for
    # activations, not in 16 GiB; there stage 1 on 2 GPUs is enough (6e9 + 9e9 bytes)
    assert zero_memory.will_it_fit_sharded(1_500_000_000, 24 * gib, 1, 0)[0]
    assert not zero_memory.will_it_fit_sharded(1_500_000_000, 16 * gib, 1, 0)[0]
    assert zero_memory.min_world_size(1_500_000_000, 16 * gib, 1) == 2
    # Llama-2 70B: its fp16 weights and gradients alone (280 GB) exceed 80 GB, so only stage
    # 3 helps: 16 x 70e9 / N <= 80 GiB from N = 14 on
    assert zero_memory.min_world_size(70_000_000_000, 80 * gib, 1) is None
    assert zero_memory.min_world_size(70_000_000_000, 80 * gib, 2) is None
    assert zero_memory.min_world_size(70_000_000_000, 80 * gib, 3) == 14
    assert zero_memory.min_world_size(7_000_000_000, 80 * gib, 1) == 2
    assert zero_memory.min_world_size(1_500_000_000, 16 * gib, 0) is None
    assert zero_memory.min_world_size(100, 10**9, 0) == 1
    with pytest.raises(ValueError):
        zero_memory.will_it_fit_sharded(100, 0, 1, 0)
