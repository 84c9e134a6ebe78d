"""python -m dpcourse.practice.train under torchrun: strategies agree, crashes restart and resume
exactly,
nothing hangs; the SLURM script is valid and its torchrun command line parses."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dpcourse.harness.launch import (
    RankDiedError,
    RankError,
    run_ranks,
    run_torchrun,
    run_torchrun_on_cluster,
)
from dpcourse.practice import checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
TIMEOUT = 240  # seconds for one torchrun job (the machine may be busy)
COMMON = ["--steps", "12", "--batch-size", "8", "--num-samples", "256", "--log-every", "4"]


def torchrun(
    nproc: int, *args: str, max_restarts: int = 0, env: dict | None = None
) -> subprocess.CompletedProcess:
    return run_torchrun("dpcourse.practice.train", nproc, args, module=True, timeout=TIMEOUT,
                        max_restarts=max_restarts, env=env, cwd=ROOT)  # fmt: skip


def final_weights(directory: Path) -> dict[str, torch.Tensor]:
    manifest = checkpoint.latest_checkpoint(directory)
    state = torch.load(
        directory / manifest["path"] / "checkpoint.pt", map_location="cpu", weights_only=True
    )
    return state["model"]


def logged_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", output)]


def main_with_output(argv: list[str]) -> str:
    """train.main on a rank, returning what it printed (as torchrun's output would hold it)."""
    import contextlib
    import io

    from dpcourse.practice import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        train.main(argv)
    return out.getvalue()


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    """Every strategy on 2 ranks (single on 1 rank with twice the batch), without clipping, so
    that all of them train on the same global batches with the same update. ddp-torch runs from
    the command line under torchrun (the crash-and-restart tests compare against it); the others
    call train.main under run_ranks, on ranks that are already running (a torchrun job starts
    three fresh interpreters)."""
    base = tmp_path_factory.mktemp("strategies")
    runs = {}
    for strategy in ("manual", "ddp-scratch", "ddp-torch", "zero", "single"):
        nproc, batch = (1, "16") if strategy == "single" else (2, "8")
        args = [*COMMON, "--batch-size", batch, "--grad-clip", "0", "--strategy", strategy]
        args += ["--checkpoint-dir", str(base / strategy)]
        if strategy == "ddp-torch":
            proc = torchrun(nproc, *args)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            output = proc.stdout + proc.stderr
        else:
            output = "".join(run_ranks(main_with_output, nproc, args, timeout=TIMEOUT))
        runs[strategy] = (output, final_weights(base / strategy))
    return runs


@pytest.mark.slow
def test_every_strategy_trains_and_its_ranks_agree(strategy_runs):
    for strategy, (output, _) in strategy_runs.items():
        nranks = 1 if strategy == "single" else 2
        assert f"replicas identical on {nranks} rank(s)" in output, output
        losses = logged_losses(output)
        assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], (strategy, losses)
        assert output.count("training mlp") == 1  # rank 0 logs, the other rank does not


@pytest.mark.slow
def test_strategies_reach_the_same_weights(strategy_runs):
    reference = strategy_runs["ddp-torch"][1]
    # 2 ranks: a + b is the same in any order, halving is exact, so NCCL and gloo agree too
    for strategy in ("manual", "ddp-scratch"):  # same sums, same division by 2: bit for bit
        for name, value in strategy_runs[strategy][1].items():
            assert torch.equal(value, reference[name]), (strategy, name)
    # measured here: 0 (zero) and 3e-8 (single); a GPU's kernels round as finely: 300x margin
    for strategy in ("zero", "single"):  # other summation orders: rounding differences only
        for name, value in strategy_runs[strategy][1].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("share_store", ["shared", "fresh"])
def test_torchrun_restarts_a_crashed_group_which_resumes_exactly(
    tmp_path, strategy_runs, share_store
):
    """Rank 1 dies at step 7 (once: a marker file); torchrun restarts both ranks, which resume
    from the checkpoint of step 4 and end with the weights of the run that never crashed. With
    torchrun's store shared across restarts (the default; the trainer prefixes its keys per
    attempt) and with a fresh store per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, what
    slurm/train.sbatch sets)."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if share_store == "fresh" else "0"}
    args = [*COMMON, "--strategy", "ddp-torch", "--grad-clip", "0", "--checkpoint-every", "4"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--crash-at-step", "7"]
    args += ["--crash-marker", str(tmp_path / "crashed-once")]
    start = time.monotonic()
    proc = torchrun(2, *args, max_restarts=1, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert (tmp_path / "crashed-once").exists()
    assert "crashing at step 7" in output and "resumed from" in output and "at step 4" in output
    got = final_weights(tmp_path / "ckpt")
    for name, value in strategy_runs["ddp-torch"][1].items():
        assert torch.equal(got[name], value), name
    assert time.monotonic() - start < TIMEOUT


@pytest.mark.slow
def test_a_crash_without_restarts_fails_fast_instead_of_hanging(tmp_path):
    start = time.monotonic()
    proc = torchrun(2, *COMMON, "--strategy", "manual", "--crash-at-step", "3", "--timeout", "30")
    assert proc.returncode != 0
    assert "crashing at step 3" in proc.stdout + proc.stderr
    assert time.monotonic() - start < 60  # well within the 30 s collective timeout + start-up


def test_a_crash_under_run_ranks_ends_the_run_with_an_error_naming_the_dead_rank():
    """Rank 0 may fail first (gloo: connection closed by peer) or the launcher may see rank 1
    die first: a race, but either way the error names rank 1's death, and quickly."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(
            train.main,
            2,
            [*COMMON, "--strategy", "ddp-scratch", "--crash-at-step", "2"],
            timeout=120,
        )
    text = str(info.value)
    assert "rank 1" in text and "died" in text, text
    # the launcher saw rank 1 die first, or rank 0's gloo saw its peer go (the connection
    # closed or reset: "Connection closed by peer", "Read error") and the report adds rank 1
    assert isinstance(info.value, RankDiedError) or "rank 1: died" in text, text
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("strategy", ["manual", "zero"])
def test_main_under_run_ranks_resumes_exactly(tmp_path, strategy):
    """Stop after 5 steps, start new ranks on the checkpoint, run to 12: the same weights as 12
    steps in one go (zero: each rank's optimizer shard comes from its own file). With 8 steps
    of warm-up, the resumed run must also resume its LR scheduler at step 5."""
    args = [*COMMON, "--grad-clip", "0", "--warmup", "8", "--strategy", strategy]
    args += ["--checkpoint-dir"]
    full = run_ranks(train.main, 2, [*args, str(tmp_path / "a")], timeout=120)
    assert full[0]["fingerprint"] == full[1]["fingerprint"]
    run_ranks(train.main, 2, [*args, str(tmp_path / "b"), "--steps", "5"], timeout=120)
    manifest = checkpoint.latest_checkpoint(tmp_path / "b")
    assert manifest["step"] == 5 and manifest["sharded_optimizer"] == (strategy == "zero")
    resumed = run_ranks(train.main, 2, [*args, str(tmp_path / "b")], timeout=120)
    assert resumed[0]["fingerprint"] == full[0]["fingerprint"]
    for a, b in zip(resumed[1]["params"], full[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_default_timeout_is_torchs_nccl_default():
    """60 s was too short for NCCL's communicator set-up or a large checkpoint's barrier;
    torch's init_process_group waits 10 minutes under NCCL (30 under gloo)."""
    assert train.parse_args([]).timeout == 600.0
    assert train.parse_args(["--timeout", "30"]).timeout == 30.0


def test_bad_command_lines_say_what_to_do(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--strategy", "zero", "--grad-clip", "-1"])
    assert "must be 0 (off) or more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs a process group: start it with torchrun"):
        train.main(["--strategy", "manual", "--steps", "1"])

    def single_on_two():
        train.main(["--strategy", "single", "--steps", "1"])

    with pytest.raises(Exception, match="runs on one process"):
        run_ranks(single_on_two, 2, timeout=120)


def test_zero_with_fp16_scaling_and_clipping_matches_torch_ddp():
    """ShardedOptimizer under a GradScaler, clipped on the global norm: the same run as torch's
    DDP with an unsharded AdamW, to float32 rounding (the sums run in other orders)."""
    args = [*COMMON, "--amp", "fp16", "--grad-clip", "0.5", "--warmup", "3"]
    got = run_ranks(train.main, 2, [*args, "--strategy", "zero"], timeout=TIMEOUT)
    want = run_ranks(train.main, 2, [*args, "--strategy", "ddp-torch"], timeout=TIMEOUT)
    for a, b in zip(got[0]["params"], want[0]["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert got[0]["fingerprint"] == got[1]["fingerprint"]


def test_single_process_transformer_with_bf16(tmp_path):
    out = train.main(
        ["--strategy", "single", "--model", "transformer", "--amp", "bf16", "--steps", "3"]
        + ["--batch-size", "8", "--num-samples", "64", "--log-every", "1"]
    )
    assert len(out["losses"]) == 3 and all(l > 0 for l in out["losses"])  # noqa: E741


# ----------------------------------------------------------------------------------- SLURM
def test_sbatch_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _torchrun_command_line() -> list[str]:
    text = SBATCH.read_text()
    command = []
    for line in text.splitlines():
        if line.lstrip().startswith("srun ") or command:
            command.append(line.split(" #")[0].rstrip().rstrip("\\"))
            if not line.rstrip().endswith("\\"):
                break
    assert command, "no srun line in the script"
    joined = " ".join(command)
    env = {"SLURM_JOB_ID": "1234", "MASTER_ADDR": "node001", "MASTER_PORT": "29500"}
    env["SLURM_JOB_NAME"] = "dpcourse-train"
    for name, value in env.items():
        joined = joined.replace(f"${name}", value)
    words = shlex.split(joined)
    return words[words.index("torchrun") + 1 :]


def test_sbatch_torchrun_command_line_parses():
    from torch.distributed.run import get_args_parser

    words = _torchrun_command_line()
    parsed = get_args_parser().parse_args(words)
    assert parsed.nnodes == "2" and parsed.nproc_per_node == "4"
    assert parsed.rdzv_backend == "c10d" and parsed.rdzv_endpoint == "node001:29500"
    assert parsed.module and parsed.training_script == "dpcourse.practice.train"
    assert parsed.max_restarts == 1
    args = train.parse_args(parsed.training_script_args)
    assert args.strategy in train.STRATEGIES and args.checkpoint_dir is not None
    assert args.amp == "auto"  # bfloat16 or float16 by the GPUs' compute capability
    text = SBATCH.read_text()
    assert "scontrol show hostnames" in text and "head -n1" in text
    assert "#SBATCH --nodes=2" in text
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text  # restarts on several nodes


def test_the_trainer_loads_chapter_9_only_for_the_zero_strategy():
    # On a fresh rank: forked from a server that imported torch alone, so no torch import to
    # pay. The code travels as a string: a function of this module would import the module,
    # which imports the trainer.
    code = (
        "import sys\n"
        "assert 'dpcourse.practice.train' not in sys.modules, 'the trainer was loaded already'\n"
        "import dpcourse.practice.train\n"
        "assert 'dpcourse.sharding.zero' not in sys.modules, 'importing the trainer loaded "
        "chapter 9'\n"
    )
    assert run_ranks(functools.partial(exec, code, {}), 1) == [None]


def _cluster_missing() -> str:
    from dpcourse.harness.cluster import ClusterUnavailable, check_available

    try:
        check_available()
    except ClusterUnavailable as exc:
        return str(exc)
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_cluster_missing()), reason=_cluster_missing() or "-")
def test_two_torchrun_agents_on_two_emulated_nodes_train_as_one_node_does():
    """As `srun torchrun ...` on two machines: an agent per node, a c10d rendezvous over the
    (emulated) network, one rank per node; the weights end as those of two ranks on one node."""
    from dpcourse.harness.cluster import EmulatedCluster

    args = [*COMMON, "--strategy", "ddp-scratch"]
    with EmulatedCluster(2, link="1gbit") as cluster:
        procs = run_torchrun_on_cluster("dpcourse.practice.train", cluster, args, module=True,
                                        timeout=TIMEOUT)
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {node}:\n{proc.stdout}\n{proc.stderr}"
    done = re.search(r"replicas identical on 2 rank\(s\) \(weights (\w+)\)", procs[0].stdout)
    assert done, procs[0].stdout
    one_node = run_ranks(main_with_output, 2, args)[0]
    assert f"(weights {done[1]})" in one_node, one_node
