"""The NCCL facts that the diagnosis lab records: ``python tools/diagnosis_gpu_probe.py``.

The lab's cells run with gloo; this probe checks, on a machine with one CUDA GPU, the NCCL facts
that the lab quotes as recorded (one rank: NCCL refuses two ranks on one GPU, so nothing here
waits for a peer):

1. a ``dist.all_reduce`` queued behind matrix products returns at once, and the
   host's clock sees the work only at ``torch.cuda.synchronize()``;
2. ``work._get_duration()`` without and with ``TORCH_NCCL_ENABLE_TIMING=1``;
3. the flight recorder's dump of an NCCL group (``TORCH_FR_BUFFER_SIZE``, and the warning for the
   older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``): the group's ranks, each record's state;
4. the lab's training loop on the GPU, timed with CUDA events, one rank sleeping 50 ms.

Each case runs in a fresh interpreter, since torch reads these variables when a group is made.
Run from the repository's root with the package on the path (``PYTHONPATH=src``).

Recorded on 2026-11-26, one NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.9: the all-reduce call
returned after 0.39 and 0.24 ms, ``torch.cuda.synchronize()`` after 214.1 and 214.3 ms;
``_get_duration()`` raised "getDuration only works if timing was enabled" without
``TORCH_NCCL_ENABLE_TIMING=1`` and returned 0.039 ms with it; ``TORCH_NCCL_TRACE_BUFFER_SIZE``
drew "Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE
instead"; the dump listed the group's ranks (``'ranks': '[0]'``) and each record as
``'completed'`` with a timeout of 600000 ms; the loop's compute read 52.0 to 52.6 ms.

Chapter 11: Appendix: the diagnosis lab (a probe for a GPU machine, not run by the book).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

CASES = {
    "timing off, old name": {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20"},
    "timing on": {"TORCH_FR_BUFFER_SIZE": "20", "TORCH_NCCL_ENABLE_TIMING": "1"},
}


def nccl_case() -> None:
    import torch
    import torch.distributed as dist

    from dpcourse.timing import DeviceClock

    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0")
    )
    a, x = torch.randn(8192, 8192, device="cuda"), torch.ones(2**26, device="cuda")
    dist.all_reduce(x), a @ a, torch.cuda.synchronize()  # warm-up
    clock = DeviceClock("cuda")
    for _ in range(10):
        a @ a
    h0, start = time.perf_counter(), clock.stamp()
    dist.all_reduce(x)
    h1, end = time.perf_counter(), clock.stamp()
    torch.cuda.synchronize()
    h2 = time.perf_counter()
    events_ms = clock.elapsed(start, end) * 1e3
    print(f"  dist.all_reduce of 256 MiB behind 10 matrix products returned after "
          f"{(h1 - h0) * 1e3:.3f} ms; torch.cuda.synchronize() after {(h2 - h0) * 1e3:.1f} ms; "
          f"CUDA events around the all-reduce: {events_ms:.3f} ms")  # fmt: skip
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    try:
        print(f"  work._get_duration(): {work._get_duration():.3f} ms")
    except RuntimeError as exc:
        print(f"  work._get_duration() raised: {exc}")
    trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
    print(f"  flight recorder: pg_config {trace['pg_config']}; records (seq, op, state, timeout):",
          [(e["collective_seq_id"], e["profiling_name"], e["state"], e["timeout_ms"])
           for e in trace["entries"]])  # fmt: skip
    dist.destroy_process_group()


def loop_case() -> None:
    from dpcourse.debugging import diagnosis
    from dpcourse.harness.launch import run_ranks

    times = run_ranks(
        diagnosis.training_steps_on_rank, 1, 5, 2, slow_rank=0, delay_s=0.05, device="cuda"
    )[0]
    print("  ms per step:", {k: [round(t * 1e3, 2) for t in ts] for k, ts in times.items()})


def main() -> None:
    import torch

    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    for name, env in CASES.items():
        print(f"{name}: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
        command = [sys.executable, __file__, "nccl"]
        subprocess.run(command, env={**os.environ, **env}, check=True, stderr=subprocess.STDOUT)
    print("the lab's loop on cuda:0 (1 rank, NCCL), rank 0 sleeping 50 ms per step:", flush=True)
    subprocess.run([sys.executable, __file__, "loop"], check=True)


if __name__ == "__main__":
    {"nccl": nccl_case, "loop": loop_case}.get(sys.argv[1] if sys.argv[1:] else "", main)()
