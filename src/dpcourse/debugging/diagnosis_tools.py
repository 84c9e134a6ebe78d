"""Appendix: the tools that name a fault for you, shown on gloo, documented for NCCL.

Used by the diagnosis lab's section 5 (``chapters/diagnosis_lab.ipynb``).

The lab's first two faults were found with per-rank timers and the stacks of a hung run. Both
are gloo facts: with gloo a collective call returns when the collective is done on that rank, so
a timer around it times the collective and a hung rank's stack is inside it. With NCCL the call
returns once the collective is queued on a CUDA stream (chapter 5, section 5.5), a straggler's
wait shows in CUDA events or at the host's next synchronisation, and a hang is ended by the
process group's watchdog. PyTorch has tools for that case, and two of them run on gloo too,
which is how this module shows them on a CPU:

* ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every process group made afterwards is wrapped in a
  checker that compares each collective's fingerprint (operation, shapes, dtypes) across the
  ranks before running it, and turns a collective that one rank never calls into an error that
  names that rank (:func:`reproduce_mismatch`, :func:`reproduce_skip`);
* the flight recorder: ``TORCH_FR_BUFFER_SIZE=N`` (for NCCL formerly
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``, deprecated in torch 2.11) keeps each rank's last N
  collectives; NCCL's watchdog dumps them on a timeout where ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``,
  and ``python -m torch.distributed.flight_recorder.fr_trace`` (``torchfrtrace``) matches the
  ranks' records (:func:`reproduce_skip` with ``records``; :func:`unmatched_collectives` matches
  them from scratch, since torch 2.11's ``fr_trace`` reads NCCL's records only);
* the duration of one collective, ``work._get_duration()``, which needs
  ``TORCH_NCCL_ENABLE_TIMING=1`` on NCCL and which gloo does not have
  (:func:`collective_duration_on_rank`).

Each demonstration runs on fresh ranks (a :class:`dpcourse.harness.launch.RankPool` of its own), in
a new gloo group with a short timeout, made after the settings: the debug level and the recorder
apply to the groups made after them, as they would from the start under ``torchrun`` with the
variables set.

Appendix: the diagnosis lab (DETAIL checks, the flight recorder, device timing).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.debugging.diagnosis import (
    SKIPPED_STEP,
    SKIPPING_RANK,
    training_steps_on_rank,
)

__all__ = [
    "DEBUG_TIMEOUT_S", "debug_group", "mismatch_on_rank", "skip_on_rank",
    "DebugRun", "flight_records", "unmatched_collectives", "analyse_flight_records",
    "collective_duration_on_rank",
]  # fmt: skip

DEBUG_TIMEOUT_S = 3.0  # the demonstrations' process-group timeout (torch's default: 30 min)
_ODD_WIDTH_RANK = 0  # the rank whose model is built one unit narrower in reproduce_mismatch
_TRACE_PREFIX = "trace_rank_"  # a dump per rank, <prefix><rank>, as fr_trace expects


def debug_group(*, detail: bool = False, records: int = 0, timeout_s: float = DEBUG_TIMEOUT_S):
    """On every rank: set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (if ``detail``) and
    ``TORCH_FR_BUFFER_SIZE=records`` (if ``records``), then make a gloo group of all ranks with
    a ``timeout_s`` timeout. torch reads the debug level when ``torch.distributed`` is imported;
    ``set_debug_level_from_env`` reads it again, so the group is made as it would be with the
    variable set before the job started."""
    if detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    if records:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(records)
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s), group_desc="lab")


def mismatch_on_rank(detail: bool) -> str:
    """One rank builds the lab's MLP one unit narrower (another config file), so its flat
    gradient is shorter than the others'; every rank trains two steps."""
    group = debug_group(detail=detail)
    width = 255 if dist.get_rank() == _ODD_WIDTH_RANK else 256
    try:
        training_steps_on_rank(2, 0, width=width, group=group)
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "finished"


def skip_on_rank(detail: bool, records: int, dump_dir: str | None) -> str:
    """The lab's fault 2 (rank SKIPPING_RANK skips step SKIPPED_STEP's all-reduce) in a debug
    group; each rank then writes its flight recorder's dump to ``dump_dir`` (NCCL's watchdog
    does that itself on a timeout), adding the group's ranks, which gloo's recorder leaves out
    and ``fr_trace`` needs to know which ranks a collective expects."""
    group = debug_group(detail=detail, records=records)
    try:
        training_steps_on_rank(4, 0, skip_rank=SKIPPING_RANK, skip_step=SKIPPED_STEP, group=group)
        outcome = "finished"
    except RuntimeError as exc:
        outcome = f"RuntimeError: {exc}"
    if dump_dir is not None:
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        ranks = str(dist.get_process_group_ranks(group))
        names = {entry["process_group"] for entry in trace["entries"]}
        trace["pg_config"] = {n: {"name": n, "desc": d, "ranks": ranks} for n, d in names}
        path = Path(dump_dir) / f"{_TRACE_PREFIX}{dist.get_rank()}"
        path.write_bytes(pickle.dumps(trace))
    return outcome


@dataclass
class DebugRun:
    """What each rank returned (``outcomes``, in rank order), or the launcher's error when a
    rank raised or died (``error``); for a run with the flight recorder, each rank's records
    (``records``: collective number, operation, input sizes), ``fr_trace``'s ``analysis`` and
    whether ``fr_trace`` could read them (``analysed``)."""

    outcomes: list[str] = field(default_factory=list)
    error: str = ""
    records: dict[int, list[tuple[int, str, list]]] = field(default_factory=dict)
    analysis: str = ""
    analysed: bool = False

    def text(self) -> str:
        """The outcomes, one line per rank (or the error)."""
        return self.error or "\n".join(f"rank {r}: {o}" for r, o in enumerate(self.outcomes))


def flight_records(dump_dir: str) -> dict[int, list[tuple[int, str, list]]]:
    """Each rank's dump in ``dump_dir``: (collective number, operation, input sizes) per record."""
    records = {}
    for path in sorted(Path(dump_dir).glob(f"{_TRACE_PREFIX}*")):
        trace = pickle.loads(path.read_bytes())
        rank = int(path.name.removeprefix(_TRACE_PREFIX))
        fields = ("collective_seq_id", "profiling_name", "input_sizes")
        records[rank] = [tuple(e[f] for f in fields) for e in trace["entries"]]
    return records


def unmatched_collectives(records: dict[int, list[tuple[int, str, list]]]) -> list[str]:
    """The collectives that not every rank recorded alike, matched by sequence number as
    ``fr_trace`` matches them: for each, which ranks recorded what, and which did not."""
    calls = {r: {seq: f"{op} {sizes}" for seq, op, sizes in rs} for r, rs in records.items()}
    found = []
    for seq in sorted(set().union(*calls.values())):
        by_call: dict[str | None, list[int]] = {}
        for rank, recorded in calls.items():
            by_call.setdefault(recorded.get(seq), []).append(rank)
        if len(by_call) > 1:
            parts = [f"ranks {rs} " + (f"called {c}" if c else "did not")
                     for c, rs in by_call.items()]  # fmt: skip
            found.append(f"collective #{seq}: " + "; ".join(parts))
    return found


def analyse_flight_records(dump_dir: str) -> tuple[bool, str]:
    """Runs ``python -m torch.distributed.flight_recorder.fr_trace DUMP_DIR`` (the command
    ``torchfrtrace`` runs), as a reader would on a job's dumps: whether it finished, and its
    output (or its error's last line: torch 2.11's stops at records that NCCL did not make)."""
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", dump_dir]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"fr_trace of torch {torch.__version__} stopped: {last}"
    return True, (done.stdout + done.stderr).strip()


def collective_duration_on_rank() -> str:
    """Runs on every rank: one asynchronous all-reduce on the default group, and what
    ``work._get_duration()`` (NCCL's own timing of a collective, on with
    ``TORCH_NCCL_ENABLE_TIMING=1``) says about it: its milliseconds, or the error."""

    work = dist.all_reduce(torch.ones(4, device=runtime.device()), async_op=True)
    work.wait()
    try:
        return f"{work._get_duration():.3f} ms"
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
