"""Tests for dpcourse.one_device.training: the loop, its bookkeeping, the progress bar,
throughput."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpcourse.one_device import data, models, training

mse = nn.functional.mse_loss


def _setup(seed: int = 0, lr: float = 1e-2):
    torch.manual_seed(seed)
    model = models.MLP()
    loader = DataLoader(data.random_regression(), batch_size=30, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    return model, loader, torch.optim.Adam(model.parameters(), lr=lr)


def test_mlp_loss_falls():
    model, loader, optimizer = _setup()
    history = training.train(model, loader, optimizer, mse, epochs=50, progress=False)
    assert len(history.epoch_losses) == 50
    assert history.steps == 50 * 4  # 100 samples in batches of 30: 30, 30, 30, 10
    assert history.num_samples == 50 * 100
    assert history.epoch_losses[-1] < 0.1 * history.epoch_losses[0]
    assert history.wall_time > 0 and history.samples_per_s > 0


def test_train_equals_a_hand_written_loop():
    model, loader, optimizer = _setup()
    reference = copy.deepcopy(model)
    history = training.train(model, loader, optimizer, mse, epochs=3, progress=False)

    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_loader = DataLoader(data.random_regression(), batch_size=30, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        for x, y in ref_loader:
            loss = mse(reference(x), y)
            ref_optimizer.zero_grad()
            loss.backward()
            ref_optimizer.step()
            losses.append(loss.item())
    assert history.step_losses == losses
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_epoch_loss_is_the_sample_weighted_mean_of_step_losses():
    model, loader, optimizer = _setup()
    history = training.train(model, loader, optimizer, mse, epochs=2, progress=False)
    first = history.step_losses[:4]
    expected = (30 * first[0] + 30 * first[1] + 30 * first[2] + 10 * first[3]) / 100
    assert abs(history.epoch_losses[0] - expected) < 1e-12


def test_train_for_a_number_of_steps_loops_over_the_loader():
    model, loader, optimizer = _setup()
    history = training.train(model, loader, optimizer, mse, steps=10, progress=False)
    assert history.steps == 10
    assert len(history.epoch_losses) == 3  # 4 + 4 + 2 steps
    assert history.epoch_ends == [4, 8, 10]
    assert history.num_samples == 100 + 100 + 60


def test_evaluate_weights_batches_by_size():
    model, loader, _ = _setup()
    x, y = data.random_regression().tensors
    expected = mse(model(x), y).item()
    unshuffled = DataLoader(data.random_regression(), batch_size=30)
    assert abs(training.evaluate(model, unshuffled, mse) - expected) < 1e-6
    assert model.training


def test_progress_bar_text():
    bar = training.ProgressBar(total=8, width=8)
    assert bar.render(8, "epoch 20/20", "loss 0.1") == "epoch 20/20 |████████| loss 0.1"
    assert bar.render(4, "a", "b") == "a |████    | b"
    assert bar.render(1, "", "") == "|█       |"
    half_char = training.ProgressBar(total=16, width=8).render(1, "", "")
    assert half_char == "|▌       |"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_in_a_terminal_and_in_a_log():
    terminal, log = _Terminal(), io.StringIO()
    for out in (terminal, log):
        bar = training.ProgressBar(total=3, width=3, min_interval=0.0, file=out)
        for i in range(1, 4):
            bar.update(i, "step", f"{i}")
        bar.close()
    assert terminal.getvalue().count("\r") >= 3 and terminal.getvalue().endswith("| 3\n")
    assert log.getvalue() == "step |███| 3\n"  # a log file gets only the final line


def test_train_prints_the_final_bar_to_stderr(capsys):
    model, loader, optimizer = _setup()
    training.train(model, loader, optimizer, mse, epochs=2)
    err = capsys.readouterr().err
    assert err.startswith("epoch 2/2 |") and "samples/s" in err and err.count("\n") == 1


def test_measure_throughput_leaves_the_model_alone():
    model = models.MLP()
    before = copy.deepcopy(model.state_dict())
    results = training.measure_throughput(
        model,
        lambda b: (torch.randn(b, 5), torch.randn(b, 2)),
        [1, 64],
        mse,
        lambda params: torch.optim.SGD(params, lr=0.1),
        steps=5,
        warmup=1,
    )
    assert [b for b, _ in results] == [1, 64]
    assert all(rate > 0 for _, rate in results)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
