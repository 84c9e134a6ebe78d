"""Every public entry point a learner calls rejects wrong arguments with an error that says what
to pass (issue 32, item 6): the launcher (run_ranks, RankPool, run_torchrun and its cluster
form), the emulated cluster and its faults, the collectives, DDP, ShardedOptimizer, FSDP, the
trainer's command line and the grader. One case per kind of mistake; each checks the type of
the error and the words that tell the learner what to do. The cases that need a process group
run together on one pair of ranks.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from dpcourse import collectives
from dpcourse.ddp.ddp import DDP
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.exercises import check, grading, run_check
from dpcourse.harness.exercises.__main__ import main as exercises_main
from dpcourse.harness.launch import RankPool, run_ranks, run_torchrun, run_torchrun_on_cluster
from dpcourse.practice import train


def work():
    return 1


def unstarted_cluster() -> EmulatedCluster:
    return EmulatedCluster(2)  # never started: no root needed


# (kind, call, exception type, a pattern the message must contain)
CASES = [
    ("run_ranks: the function's result instead of the function",
     lambda: run_ranks(work(), 2), TypeError, r"pass the function itself, run_ranks\(work, 2\)"),
    ("run_ranks: world size and function swapped",
     lambda: run_ranks(2, work), TypeError, r"the function comes first: run_ranks\(fn, world_siz"),
    ("run_ranks: world size 0",
     lambda: run_ranks(work, 0), ValueError, r"world_size must be a positive int"),
    ("run_ranks: world size 2.0",
     lambda: run_ranks(work, 2.0), ValueError, r"world_size must be a positive int .* got 2.0"),
    ("run_ranks: unknown backend",
     lambda: run_ranks(work, 2, backend="NCCL"), ValueError,
     r"backend must be 'auto', 'gloo', 'nccl' or 'mpi', got 'NCCL'"),
    ("run_ranks: timeout not a positive number",
     lambda: run_ranks(work, 2, timeout="60"), ValueError,
     r"timeout must be a number of seconds above 0, got '60'"),
    ("run_ranks: cluster= something else",
     lambda: run_ranks(work, 2, cluster=2), TypeError,
     r"cluster must be an EmulatedCluster, started \(`with EmulatedCluster"),
    ("run_ranks: a cluster not started",
     lambda: run_ranks(work, 2, cluster=unstarted_cluster()), RuntimeError,
     r"not started: use it as `with EmulatedCluster"),
    ("run_ranks: world size that does not fill the cluster",
     lambda: run_ranks(work, 3, cluster=EmulatedCluster(2)), ValueError,
     r"world_size 3 does not fit 2 node.s. of 1 rank.s.: run 2 ranks"),
    ("run_ranks: an argument that cannot travel to the ranks",
     lambda: run_ranks(work, 2, threading.Lock()), TypeError,
     r"Pass plain data .* create anything else .*inside the function"),
    ("RankPool: threads negative",
     lambda: RankPool(2, threads=-1), ValueError, r"threads must be an int from 0"),
    ("RankPool: start_timeout 0",
     lambda: RankPool(2, start_timeout=0), ValueError,
     r"start_timeout must be a number of seconds above 0"),
    ("RankPool.run: timeout 0",
     lambda: RankPool(2).run(work, timeout=0), ValueError,
     r"timeout must be a number of seconds above 0, got 0"),
    ("run_torchrun: nproc 0",
     lambda: run_torchrun("train.py", 0), ValueError, r"nproc must be a positive int"),
    ("run_torchrun: no such script",
     lambda: run_torchrun("dpcourse.practice.train", 1), FileNotFoundError,
     r"pass the path of a Python script \(to run a module, pass its name with module=True\)"),
    ("run_torchrun: max_restarts negative",
     lambda: run_torchrun(__file__, 1, max_restarts=-1), ValueError,
     r"max_restarts must be an int from 0"),
    ("run_torchrun_on_cluster: not a cluster",
     lambda: run_torchrun_on_cluster("dpcourse.practice.train", 2, module=True), TypeError,
     r"cluster must be an EmulatedCluster \(`with EmulatedCluster\(nodes=2\) as cluster:`\)"),
    ("run_torchrun_on_cluster: a cluster not started",
     lambda: run_torchrun_on_cluster("dpcourse.practice.train", EmulatedCluster(2), module=True),
     RuntimeError, r"not started: run the agents inside `with EmulatedCluster"),
    ("EmulatedCluster: no nodes",
     lambda: EmulatedCluster(0), ValueError, r"nodes must be an int from 1 to 64, got 0"),
    ("EmulatedCluster: a rate tc cannot read",
     lambda: EmulatedCluster(2, link="1 GB/s"), ValueError,
     r"link must be a rate above 0 .* such as '1gbit', '400mbit'"),
    ("EmulatedCluster: node_link 0",
     lambda: EmulatedCluster(2, node_link="0mbit"), ValueError,
     r"node_link must be a rate above 0"),
    ("EmulatedCluster: collective_timeout 0",
     lambda: EmulatedCluster(2, collective_timeout=0), ValueError,
     r"collective_timeout must be a number of seconds above 0"),
    ("fault: a node the cluster does not have",
     lambda: EmulatedCluster(2).cut_link(2), ValueError,
     r"node must be the index of one of the cluster's 2 nodes, an int from 0 to 1; got 2"),
    ("fault: a slow rate tc cannot read",
     lambda: EmulatedCluster(2).slow_link(1, 100), ValueError, r"rate must be a rate above 0"),
    ("fault: two triggers at once",
     lambda: EmulatedCluster(2).kill_node(1, at_step=3, after=1), ValueError,
     r"give one trigger of at_step, after and when"),
    ("fault: a step below 0",
     lambda: EmulatedCluster(2).cut_link(1, at_step=-1), ValueError,
     r"at_step must be a step number \(an int from 0\)"),
    ("fault: when= not a function",
     lambda: EmulatedCluster(2).restore_link(1, when=5), ValueError,
     r"when must be a function of no arguments"),
    ("fault: on a cluster not started",
     lambda: EmulatedCluster(2).cut_link(1), RuntimeError,
     r"inject faults inside `with EmulatedCluster"),
    ("collectives: called outside any process group",
     lambda: collectives.ring_all_reduce(torch.ones(4)), RuntimeError,
     r"Call them inside a function started with dpcourse.harness.launch.run_ranks"),
    ("DDP: outside any process group",
     lambda: DDP(nn.Linear(2, 2)), RuntimeError,
     r"Run the code on ranks with dpcourse.harness.launch.run_ranks"),
    ("grader: a submission that is not there",
     lambda: grading.grade([Path("no/such/notebook.ipynb")]), FileNotFoundError,
     r"no such submission: no/such/notebook.ipynb \(pass notebooks, or folders of them\)"),
    ("grader: a timeout of 0",
     lambda: grading.grade([Path(__file__)], timeout=0), ValueError,
     r"timeout must be a number of seconds above 0"),
    ("grader: jobs 0",
     lambda: grading.grade([Path(__file__)], jobs=0), ValueError,
     r"jobs must be a positive number of submissions at once"),
    ("exercise checks: a check that does not exist",
     lambda: check.lr_warmpu, AttributeError,
     r"there is no check called 'lr_warmpu'; the checks are: .*lr_warmup"),
    ("exercise checks: an exercise label that does not exist",
     lambda: run_check("ex-8-lr-warmup", work), KeyError,
     r"no exercise is labelled 'ex-8-lr-warmup'; the labels with checks are .*ex-8-lr"),
]


@pytest.mark.parametrize("kind, call, error, says", CASES, ids=[c[0] for c in CASES])
def test_a_wrong_argument_gets_an_error_that_says_what_to_pass(kind, call, error, says):
    with pytest.raises(error, match=says):
        call()


# The trainer's command line: argparse prints the message and exits with status 2.
TRAINER = [
    ("--steps 0", r"--steps must be at least 1, got 0"),
    ("--log-every 0", r"--log-every must be at least 1, got 0"),
    ("--checkpoint-every -1", r"--checkpoint-every must be 0 \(off\) or more, got -1"),
    ("--lr 0", r"--lr must be above 0, got 0.0"),
    ("--timeout -5", r"--timeout must be above 0, got -5.0"),
    ("--crash-at-step 100 --steps 10", r"--crash-at-step must be a step from 0 to --steps - 1 \(9"),
    ("--crash-rank -1", r"--crash-rank must be a rank \(0 or more\), got -1"),
    ("--strategy ddp",
     r"argument --strategy: invalid choice: 'ddp' \(choose from '?single'?, '?manual"),
]


@pytest.mark.parametrize("argv, says", TRAINER, ids=[t[0] for t in TRAINER])
def test_the_trainers_command_line_says_what_to_pass(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(says, err), err


def test_the_trainer_says_when_no_batch_fits_or_no_process_group_exists():
    with pytest.raises(SystemExit, match=r"4 samples make no batch of 16 .* lower --batch-size "
                                         r"or raise --num-samples"):
        train.main(["--strategy", "single", "--num-samples", "4", "--steps", "1"])
    with pytest.raises(SystemExit, match=r"needs a process group: start it with torchrun, e.g. "
                                         r"torchrun --standalone --nproc-per-node=2"):
        train.main(["--strategy", "ddp-scratch", "--steps", "1"])


def test_the_trainer_refuses_a_checkpoint_of_another_world_size_unless_told(tmp_path):
    (tmp_path / "latest.json").write_text('{"step": 4, "path": "step-00000004", '
                                          '"world_size": 2, "sharded_optimizer": false}')
    with pytest.raises(SystemExit, match=r"written by 2 ranks and this job has 1: resume with 2 "
                                         r"ranks to continue exactly, or pass --allow-resize"):
        train.main(["--strategy", "single", "--steps", "8", "--checkpoint-dir", str(tmp_path)])


def test_the_grade_command_turns_a_bad_argument_into_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        exercises_main(["grade", "no/such/folder", "--out", "/dev/null"])
    assert exit_.value.code == 2
    assert "grade: no such submission: no/such/folder" in capsys.readouterr().err


def mistakes_on_rank() -> dict[str, tuple[str, str]]:
    """Each mistake that needs a process group, made on both ranks: {kind: (error, message)}."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from dpcourse import collectives
    from dpcourse.ddp import ddp
    from dpcourse.sharding.fsdp import FSDP
    from dpcourse.sharding.zero import ShardedOptimizer

    rank = dist.get_rank()
    calls = {
        "collectives: a list instead of a tensor":
            lambda: collectives.ring_all_reduce([1.0, 2.0]),
        "collectives: an op torch does not name so":
            lambda: collectives.ring_all_reduce(torch.ones(4), op="avg"),
        "collectives: a tensor that is not contiguous":
            lambda: collectives.ring_all_reduce(torch.ones(4, 4).t()),
        "collectives: a root that is not a rank":
            lambda: collectives.tree_broadcast(torch.ones(4), src=5),
        "collectives: tensors of different sizes on different ranks":
            lambda: collectives.ring_all_reduce(torch.ones(4 + rank)),
        "DDP: a function instead of a module": lambda: ddp.DDP(lambda x: x),
        "DDP: a negative bucket cap": lambda: ddp.DDP(nn.Linear(2, 2), bucket_cap_mb=-1),
        "DDP: an option of torch's DDP that ours has no use for":
            lambda: ddp.DDP(nn.Linear(2, 2), mixed_precision=True),
        "DDP: an unknown variant of chapter 7": lambda: ddp.wrap("fast", nn.Linear(2, 2)),
        "ShardedOptimizer: an optimizer instead of its class":
            lambda: ShardedOptimizer(nn.Linear(2, 2).parameters(),
                                     torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
        "ShardedOptimizer: stage 3": lambda: ShardedOptimizer(
            nn.Linear(2, 2).parameters(), torch.optim.SGD, stage=3, lr=0.1),
        "ShardedOptimizer: no parameters (a used-up generator)":
            lambda: ShardedOptimizer([], torch.optim.SGD, lr=0.1),
        "FSDP: a layer that is not in the model":
            lambda: FSDP(nn.Sequential(nn.Linear(2, 2)), layers=["5"]),
        "FSDP: a compute dtype it does not offer":
            lambda: FSDP(nn.Linear(2, 2), compute_dtype="fp8"),
        "FSDP: reshard_after_forward as fully_shard's int":
            lambda: FSDP(nn.Linear(2, 2), reshard_after_forward=2),
        "FSDP: the model's parameters instead of the model":
            lambda: FSDP(nn.Linear(2, 2).parameters()),
    }
    seen = {}
    for kind, call in calls.items():
        try:
            call()
            seen[kind] = ("no error", "")
        except Exception as exc:
            seen[kind] = (type(exc).__name__, str(exc))
    return seen


ON_RANKS = {
    "collectives: a list instead of a tensor": ("TypeError", r"expected a torch.Tensor, got list"),
    "collectives: an op torch does not name so":
        ("ValueError", r"op must be one of \('sum', 'mean', 'max', 'min'\), got 'avg'"),
    "collectives: a tensor that is not contiguous":
        ("ValueError", r"pass t.contiguous\(\) and copy the result back"),
    "collectives: a root that is not a rank":
        ("ValueError", r"the root rank must be in \[0, 1\], got 5"),
    "collectives: tensors of different sizes on different ranks":
        ("ValueError", r"every rank must pass a tensor of the same size"),
    "DDP: a function instead of a module": ("TypeError", r"DDP wraps an nn.Module, got function"),
    "DDP: a negative bucket cap": ("ValueError", r"bucket_cap_mb must be 0 or more, got -1"),
    "DDP: an option of torch's DDP that ours has no use for":
        ("TypeError", r"does not take mixed_precision= \(cast the model or use torch.autocast"),
    "DDP: an unknown variant of chapter 7":
        ("ValueError", r"unknown variant 'fast'; the variants are \('none', 'step 2'"),
    "ShardedOptimizer: an optimizer instead of its class":
        ("TypeError", r"a torch optimizer class such as torch.optim.AdamW \(the class, not an "
                      r"instance\)"),
    "ShardedOptimizer: stage 3":
        ("ValueError", r"stage must be 1 .* or 2 .*; for stage 3 use torch.distributed.fsdp"),
    "ShardedOptimizer: no parameters (a used-up generator)":
        ("ValueError", r"empty parameter list: pass model.parameters\(\)"),
    "FSDP: a layer that is not in the model":
        ("ValueError", r"no submodule named '5' to shard; submodules with parameters: 0"),
    "FSDP: a compute dtype it does not offer":
        ("ValueError", r"compute_dtype must be one of \(None, torch.float32"),
    "FSDP: reshard_after_forward as fully_shard's int":
        ("TypeError", r"reshard_after_forward must be True or False"),
    "FSDP: the model's parameters instead of the model":
        ("TypeError", r"FSDP wraps a torch.nn.Module .*got generator: FSDP\(model\), not "
                      r"FSDP\(model.parameters\(\)\)"),
}


@pytest.fixture(scope="module")
def seen_on_ranks():
    return run_ranks(mistakes_on_rank, 2, backend="gloo", timeout=120)


@pytest.mark.parametrize("kind", list(ON_RANKS))
def test_a_wrong_argument_on_ranks_gets_an_error_that_says_what_to_pass(kind, seen_on_ranks):
    error, says = ON_RANKS[kind]
    for rank, seen in enumerate(seen_on_ranks):
        assert seen[kind][0] == error, (rank, seen[kind])
        assert re.search(says, seen[kind][1]), (rank, seen[kind][1])

