"""mixed_precision.choose_amp: bfloat16 where the machine has it, float16 with loss scaling on
GPUs below compute capability 8.0 (Colab's and Kaggle's T4), each answer forced here by
monkeypatching what torch reports; and the trainer's ``--amp auto`` (chapter 8, issue 33)."""

from __future__ import annotations

import pytest
import torch

from dpcourse import runtime
from dpcourse.practice import mixed_precision, train
from dpcourse.practice.mixed_precision import choose_amp


@pytest.fixture
def gpu(monkeypatch):
    """A pretend CUDA machine whose GPU has the compute capability the test sets."""
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capability["value"])
    return capability


@pytest.mark.parametrize("capability, dtype, scaling", [
    ((7, 0), torch.float16, True),   # V100
    ((7, 5), torch.float16, True),   # T4: Colab, Kaggle's T4 x2
    ((8, 0), torch.bfloat16, False),  # A100
    ((8, 6), torch.bfloat16, False),  # RTX 30xx, A10
    ((9, 0), torch.bfloat16, False),  # H100, H200
])
def test_a_gpu_gets_bf16_from_ampere_on_and_fp16_with_scaling_before(gpu, capability, dtype,
                                                                     scaling):
    gpu["value"] = capability
    choice = choose_amp("cuda:0")
    assert (choice.dtype, choice.loss_scaling) == (dtype, scaling)
    assert f"{capability[0]}.{capability[1]}" in choice.reason


def test_the_default_device_is_this_processs(gpu, monkeypatch):
    gpu["value"] = (7, 5)
    monkeypatch.setattr("dpcourse.runtime.device", lambda: torch.device("cuda", 0))
    assert choose_amp().dtype == torch.float16


def test_the_cpu_gets_bf16_without_a_scaler(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    choice = choose_amp(torch.device("cpu"))
    assert (choice.dtype, choice.loss_scaling) == (torch.bfloat16, False)
    if not torch.cuda.is_available():
        assert choose_amp().dtype == torch.bfloat16  # runtime.device() is the CPU here


def test_the_trainer_uses_it_for_amp_auto(capsys):
    out = train.main(["--strategy", "single", "--amp", "auto", "--steps", "2", "--batch-size",
                      "8", "--num-samples", "64", "--log-every", "1"])
    assert len(out["losses"]) == 2
    # the trainer's one rank runs on runtime.device(): cuda:0 where there is a GPU
    reason = mixed_precision.choose_amp(runtime.device()).reason
    assert f"--amp auto: {reason}" in capsys.readouterr().out
