"""``python -m dpcourse.harness.bench fsdp_streams``: what the GPU runs, stream by stream, in our
FSDP.

On a GPU, :class:`dpcourse.sharding.fsdp.FSDP`'s communication thread queues the all-gathers and the
reduce-scatters on CUDA streams of their own
(:class:`dpcourse.sharding.fsdp_comm.StreamedCommThread`), so that the GPU can run them beside
the layers' matmuls on the compute stream. Those streams carry the
ring's copies and adds; with NCCL, the messages themselves are NCCL's kernels, which
ProcessGroupNCCL queues on streams of its own (each waiting for the stream it was issued from):
the trace names those rows "NCCL". This benchmark profiles one training step of the benchmark's
MLP with ``torch.profiler`` on each rank's GPU, with and without prefetch, and reports how long
each stream was busy and how long the communication streams were busy *while the compute stream
was too* (:func:`stream_overlap`). It needs GPUs; chapter 9 plots its recorded result
(``benchmarks/<gpu>/fsdp_streams.json``) where there are none.

Chapter 9: FSDP's streams on a GPU.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dpcourse import runtime
from dpcourse.harness.bench import zero as zero_bench
from dpcourse.harness.bench.fsdp import LR
from dpcourse.harness.launch import run_ranks
from dpcourse.sharding.fsdp import FSDP

__all__ = ["STREAM_ROWS", "stream_trace_on_rank", "stream_overlap"]

HELP = "FSDP's CUDA streams, profiled: all-gathers and reduce-scatters beside compute (GPUs only)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")


def run(args: argparse.Namespace) -> dict:
    traces = {}
    for prefetch in (True, False):
        traces[f"prefetch={prefetch}"] = run_ranks(
            stream_trace_on_rank, args.world_size, prefetch, args.batch, args.width, 1001,
            timeout=600)[0]
    return {"world_size": args.world_size, "width": args.width, "batch_per_rank": args.batch,
            "traces": traces, "overlap": {k: stream_overlap(t) for k, t in traces.items()}}


def report(result: dict) -> None:
    print(f"FSDP on the MLP of width {result['width']}, batch {result['batch_per_rank']} per "
          f"rank, {result['world_size']} ranks: rank 0's GPU during one step (ms)")
    for name, overlap in result["overlap"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in overlap.items()))


STREAM_ROWS = ("compute", "all-gather", "reduce-scatter")


def _kind_of_gpu_work(name: str, category: str) -> str:
    lowered = name.lower()
    if category != "kernel" or lowered.startswith("memcpy"):
        return "copy"
    if lowered.startswith("nccl"):
        return "NCCL kernel"
    if any(k in lowered for k in ("gemm", "cutlass", "xmma", "matmul", "sm80_", "sm90_")):
        return "matmul"
    return "other kernel"


def stream_trace_on_rank(prefetch: bool = True, batch: int = 64, width: int = 1024,
                         out: int = 1001) -> dict:
    """Runs on every rank, on a GPU: what the GPU ran, stream by stream, during the third
    training step of :class:`dpcourse.sharding.fsdp.FSDP` on the benchmark's MLP (the first records
    the layers' order, the second warms up), profiled with ``torch.profiler``.

    Returns ``{"device": ..., "backend": ..., "world_size": N, "events": [(row, kind, name,
    start_s, end_s), ...]}``: row is "compute" (the stream the matmuls run on), one of the
    communication thread's streams, "all-gather" and "reduce-scatter" (the ring's copies and
    adds), "NCCL <id>" (a stream of ProcessGroupNCCL's own, where NCCL's kernels run: the ring's
    messages, with a GPU per rank) or "stream <id>" (any other); kind is "matmul", "NCCL
    kernel", "copy" (memory copies and sets: where ranks share a GPU over gloo, a gather's
    chunks cross through host memory) or "other kernel"; times are from the step's first GPU
    work. The trace
    numbers streams its own way: before the step, one spin kernel on each stream, in the order
    of :data:`STREAM_ROWS`, names them. Chapter 9 plots it (:func:`stream_overlap` sums it)."""
    device = runtime.device()
    if device.type != "cuda":
        raise RuntimeError(f"stream_trace_on_rank profiles CUDA streams; this rank is on "
                           f"{device}: run it where the ranks have GPUs")
    fsdp = FSDP(zero_bench.make_mlp(width, out).to(device), prefetch=prefetch)
    opt = torch.optim.Adam(fsdp.parameters(), lr=LR)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, out, generator=g).to(device)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x), y).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize(device)
    streams = [torch.cuda.current_stream(device), *(fsdp.comm.streams[k] for k in STREAM_ROWS[1:])]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for stream in streams:  # the markers, one at a time
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1000)
            torch.cuda.synchronize(device)
        dist.barrier()
        step()
        torch.cuda.synchronize(device)
    fsdp.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    work = sorted((e for e in trace.get("traceEvents", [])
                   if e.get("ph") == "X" and e.get("cat") in gpu), key=lambda e: e["ts"])
    markers = [e for e in work if "spin" in e["name"].lower()][: len(STREAM_ROWS)]
    if len(markers) < len(STREAM_ROWS):  # nothing else ran before them (they were waited for)
        markers = [e for e in work if e["cat"] == "kernel"][: len(STREAM_ROWS)]
    rows = {e["args"]["stream"]: row for e, row in zip(markers, STREAM_ROWS, strict=False)}
    after = markers[-1]["ts"] + markers[-1]["dur"] if markers else float("-inf")
    step_work = [e for e in work if e["ts"] > after]
    t0 = step_work[0]["ts"] if step_work else 0.0
    nccl = {e["args"]["stream"] for e in step_work if e["name"].lower().startswith("nccl")}

    def row_of(stream: int) -> str:
        return rows.get(stream) or (f"NCCL {stream}" if stream in nccl else f"stream {stream}")

    events = [(row_of(e["args"]["stream"]),
               _kind_of_gpu_work(e["name"], e["cat"]), e["name"][:80],
               (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6) for e in step_work]
    info = runtime.current()
    return {"device": torch.cuda.get_device_name(device), "backend": info.backend,
            "world_size": info.world_size, "prefetch": prefetch, "events": events}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def stream_overlap(trace: dict) -> dict[str, float]:
    """Seconds each row of :func:`stream_trace_on_rank`'s trace was busy (its spans merged),
    the step's length, and ``"<row> beside compute"``: how long that communication stream was
    busy while the compute stream was too, the overlap that prefetch and the side streams buy."""
    by_row: dict[str, list[tuple[float, float]]] = {}
    for row, _, _, start, end in trace["events"]:
        by_row.setdefault(row, []).append((start, end))
    busy = {row: _union(spans) for row, spans in by_row.items()}
    result = {f"{row} busy": sum(b - a for a, b in spans) for row, spans in busy.items()}
    ends = [end for *_, end in trace["events"]]
    result["step"] = max(ends) if ends else 0.0
    compute = busy.get("compute", [])
    for row, spans in busy.items():
        if row != "compute":
            result[f"{row} beside compute"] = sum(
                max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in compute)
    return result
