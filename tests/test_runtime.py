"""Backend and device choice, machine description, and the process group under torchrun."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from dpcourse import runtime
from dpcourse.harness.launch import run_ranks, run_torchrun


@pytest.mark.parametrize(
    "world_size,gpus,expected",
    [
        (1, 0, "gloo"),
        (4, 0, "gloo"),
        (4, 1, "gloo"),
        (4, 3, "gloo"),
        (2, 2, "nccl"),
        (1, 8, "nccl"),
    ],
)
def test_choose_backend_needs_a_gpu_per_rank_for_nccl(world_size, gpus, expected, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert runtime.choose_backend(world_size, gpus) == expected


def test_choose_backend_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        runtime.choose_backend(0, 0)


@pytest.mark.parametrize(
    "local_rank,local_world,backend,gpus,expected",
    [
        (0, 2, "gloo", 0, "cpu"),
        (3, 4, "gloo", 0, "cpu"),
        (3, 4, "gloo", 1, "cuda:0"),  # ranks share the one GPU
        (3, 4, "gloo", 2, "cuda:1"),  # round-robin over the GPUs
        (3, 4, "nccl", 4, "cuda:3"),
    ],
)
def test_device_for_rank(local_rank, local_world, backend, gpus, expected):
    assert str(runtime.device_for_rank(local_rank, local_world, backend, gpus)) == expected


def test_nccl_with_too_few_gpus_says_what_to_do():
    with pytest.raises(RuntimeError, match="backend='gloo'"):
        runtime.device_for_rank(0, 4, "nccl", gpus=2)


def test_describe_machine_matches_torch():
    m = runtime.describe_machine()
    assert m.cpus == os.cpu_count()
    assert len(m.gpus) == runtime.gpu_count() == len(m.gpu_memory_gib)
    assert m.torch_version == torch.__version__
    assert m.backends["gloo"]
    text = m.summary()
    assert f"CPU cores:    {m.cpus}" in text and f"GPUs:         {len(m.gpus)}" in text
    assert m.threads == torch.get_num_threads()
    assert f"(torch uses {m.threads} thread" in text


def test_machine_line_says_in_one_line_what_the_summary_says(monkeypatch):
    m = runtime.describe_machine()
    line = m.line()
    cores = f"{m.cpus} CPU core"
    assert "\n" not in line and cores in line
    # the GPUs first where there are any ("1 GPU (NVIDIA H200, 140 GiB), 16 CPU cores ...")
    assert line.startswith(f"{len(m.gpus)} GPU" if m.gpus else cores)
    assert f"(torch uses {m.threads} thread" in line and f"torch {m.torch_version}" in line
    assert line.endswith(f"2 ranks use {runtime.choose_backend(2, len(m.gpus))}")
    # A GPU machine, as describe_machine would see it: GPUs alike counted once, NCCL for 8 ranks
    # (a GPU each), gloo for 9; a machine of two kinds of GPU names each kind.
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    node = runtime.Machine(
        cpus=16, gpus=("NVIDIA H100 80GB HBM3",) * 8, gpu_memory_gib=(79.1,) * 8,
        torch_version="2.11.0", cuda_version="12.8", threads=1,
    )
    assert node.line(8) == (
        "8 GPUs (NVIDIA H100 80GB HBM3, 79 GiB), 16 CPU cores (torch uses 1 thread); "
        "torch 2.11.0 (CUDA 12.8); 8 ranks use nccl"
    )
    assert node.line(9).endswith("9 ranks use gloo") and node.line(1).endswith("1 rank uses nccl")
    mixed = runtime.Machine(
        cpus=4, gpus=("Tesla T4", "Tesla T4", "Tesla P100"), gpu_memory_gib=(14.7, 14.7, 15.9),
        torch_version="2.11.0", cuda_version="12.8", threads=4,
    )
    assert mixed.line().startswith(
        "3 GPUs (2 x Tesla T4, 15 GiB; Tesla P100, 16 GiB), 4 CPU cores (torch uses 4 threads)"
    )
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        m.line(0)


def test_current_outside_a_process_group_is_one_rank():
    info = runtime.current()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.device == runtime.device_for_rank(0, 1, runtime.choose_backend(1))
    assert runtime.is_rank_zero()


def test_init_without_environment_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        runtime.init_process_group()


def test_print0_prints_on_rank_zero_only(capfd):
    def hello():
        runtime.print0("only once")
        return runtime.is_rank_zero()

    assert run_ranks(hello, 3) == [True, False, False]
    out = capfd.readouterr().out
    assert out.count("only once") == 1 and "[rank 0] only once" in out


def test_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import torch, torch.distributed as dist
        from dpcourse import runtime

        info = runtime.init_process_group()
        t = torch.tensor([float(info.rank + 1)], device=info.device)
        dist.all_reduce(t)
        print(f"rank={info.rank} world={info.world_size} local={info.local_rank} "
              f"backend={info.backend} total={t.item():.0f}", flush=True)
        assert runtime.current() == info
        runtime.teardown()
        runtime.teardown()  # safe twice
    """)
    )
    proc = run_torchrun(script, 2, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    backend = runtime.choose_backend(2)
    for r in range(2):
        assert f"rank={r} world=2 local={r} backend={backend} total=3" in proc.stdout
