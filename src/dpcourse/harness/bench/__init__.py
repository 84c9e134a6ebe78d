"""Benchmarks: ``python -m dpcourse.harness.bench NAME [options]``.

Each benchmark measures the course's implementation and PyTorch's counterpart side by side in
one run (interleaved repetitions, medians), prints the ratios, and can write JSON with the
machine it ran on (``--json FILE``). Speed is checked here, never by timed unit tests.

A benchmark is a module ``dpcourse/harness/bench/<name>.py`` defining ``HELP`` (one line),
``add_arguments(parser)``, ``run(args) -> dict`` (JSON-able) and ``report(result)`` (prints the
table); :func:`main` finds every such module. ``python -m dpcourse.harness.bench --help`` lists
them.

Chapter 0: the course-wide measurement rigs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pkgutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from dpcourse import runtime

__all__ = ["benchmarks", "main", "recorded", "interleaved_step_times"]

# Results recorded with --json, kept in the repository next to src/ (see benchmarks/README.md).
RECORDED = Path(__file__).resolve().parents[4] / "benchmarks"


def recorded(name: str, machine: str = "cpu-2core") -> dict | None:
    """The recorded result ``benchmarks/<machine>/<name>.json`` (with its ``machine``, ``date``
    and ``command``), or None where it is not there (the package installed without the
    repository). Chapters show it where they cannot measure, labelled as recorded."""
    path = RECORDED / machine / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def interleaved_step_times(
    steps: Sequence[Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device,
    *,
    rotate: bool = False,
    after_round: Callable[[int], object] | None = None,
) -> list[list[float]]:
    """Runs on every rank: seconds per call of each of ``steps`` (one training step of each
    variant), the steps taking turns, round after round, so that drifts in the machine's load hit
    them all alike. Each starts after a barrier and counts as long as its slowest rank took (one
    all-reduce of the round's times, on ``device``: NCCL's are on the GPU); the first ``warmup``
    rounds are left out. ``rotate``: the step that goes first changes every round, so that none
    always follows another. ``after_round(i)`` runs after round ``i`` on every rank (a check
    that the variants agree). Returns each step's times, in the order of ``steps``. The ddp,
    zero and fsdp benchmarks time their variants with it."""
    times: list[list[float]] = [[] for _ in steps]
    slowest = torch.zeros(len(steps), dtype=torch.float64, device=device)
    for i in range(warmup + repeats):
        for j in range(len(steps)):
            k = (i + j) % len(steps) if rotate else j
            dist.barrier()
            runtime.synchronize(device)
            t0 = time.perf_counter()
            steps[k]()
            runtime.synchronize(device)
            slowest[k] = time.perf_counter() - t0
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if after_round is not None:
            after_round(i)
        if i >= warmup:
            for k, seconds in enumerate(slowest.tolist()):
                times[k].append(seconds)
    return times


def benchmarks() -> dict[str, ModuleType]:
    """Every benchmark module of this package, by name."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            if all(hasattr(module, a) for a in ("HELP", "add_arguments", "run", "report")):
                found[info.name] = module
    return found


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark from the command line; returns the exit status."""
    modules = benchmarks()
    parser = argparse.ArgumentParser(
        prog="python -m dpcourse.harness.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="name", required=True)
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        module.add_arguments(p)
        p.add_argument("--json", help="also write the results, with the machine, to this file")
    args = parser.parse_args(argv)

    machine = runtime.describe_machine()
    print(
        f"machine: {machine.cpus} CPU cores, GPUs: {list(machine.gpus) or 'none'}, "
        f"torch {machine.torch_version}"
    )
    module = modules[args.name]
    result = module.run(args)
    module.report(result)
    if args.json:
        record = {
            "benchmark": args.name,
            "command": "python -m dpcourse.harness.bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": asdict(machine),
            **result,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0
