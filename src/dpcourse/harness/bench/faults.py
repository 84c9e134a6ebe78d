"""``python -m dpcourse.harness.bench faults``: faults injected into an emulated cluster, timed.

Each fault of :class:`dpcourse.harness.cluster.EmulatedCluster` on a loop of all-reduces, the
ranks calling :func:`dpcourse.harness.cluster.fault_point` before every step:

* ``cut``: node N-1's link cut at step 3, ``--repeats`` times on a fresh cluster each: the
  seconds from the cut to the run's error (the collective timeout bounds them), whether the
  error named the node and the collective on every rank's line, and what was left behind
  (namespaces, cables, processes in the nodes) once the cluster closed;
* ``kill``: node N-1's processes killed at step 3, likewise;
* ``restore``: the link cut for ``--outage`` seconds within the timeout: how long the step that
  met it stalled;
* ``slow``: a straggler node, its link slowed to ``--slow-rate``: each rank's time before and
  inside the all-reduce of a ``--grad-bytes`` gradient, at the cluster's rate and at the slowed
  one, beside chapter 10's step-time model for each rate (:func:`dpcourse.cost.scaling.step_time`).

``make faults`` runs it with 20 repetitions of the cut on 2 and 3 nodes and records the result in
``benchmarks/cpu-2core/faults.json`` (chapter 8 shows that run where it cannot build the
cluster). Needs root (or CAP_NET_ADMIN).

Chapter 8: training at scale in practice (failures across nodes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from dpcourse.cost import scaling
from dpcourse.cost.hardware import rate_bits
from dpcourse.harness.cluster import EmulatedCluster, fault_point
from dpcourse.harness.launch import RankError, run_ranks
from dpcourse.harness.netns import leftovers, namespace_inode, processes_in

HELP = "cut, kill, restore and slow one node of an emulated cluster, timed (chapter 8)"
FAULT_STEP = 3
_WHAT = ("cut", "kill", "restore", "slow")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--what", nargs="+", choices=_WHAT, default=list(_WHAT))
    parser.add_argument("--repeats", type=int, default=3, help="runs of cut and kill per size")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="the clusters' collective timeout, seconds")
    parser.add_argument("--outage", type=float, default=1.0, help="seconds a restored link is cut")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--slow-rate", default="100mbit")
    parser.add_argument("--grad-bytes", type=int, default=2**20)
    parser.add_argument("--compute-ms", type=float, default=20.0,
                        help="each step's stand-in for compute (a sleep, so that it does not "
                             "compete for the cores)")


def steps_on_rank(steps: int, numel: int = 256, compute_s: float = 0.0) -> dict:
    """``steps`` steps of ``compute_s`` seconds of stand-in compute (a sleep) and an all-reduce
    of ``numel`` floats, calling the fault point first; returns each step's seconds before and
    inside the all-reduce (the diagnosis lab's two measurements)."""
    grad = torch.ones(numel)
    before, inside = [], []
    for step in range(steps):
        fault_point(step)
        start = time.perf_counter()
        if compute_s:
            time.sleep(compute_s)
        middle = time.perf_counter()
        dist.all_reduce(grad)
        before.append(middle - start)
        inside.append(time.perf_counter() - middle)
    return {"pid": os.getpid(), "before": before, "inside": inside}


def _closed_clean(cluster: EmulatedCluster, pids: set[int]) -> dict:
    """Close ``cluster`` and say what it left: names, processes in its nodes, rank processes."""
    tag = cluster.tag
    inodes = {namespace_inode(n.namespace) for n in cluster.nodes}
    cluster.close()
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return {"names": leftovers(tag), "in_nodes": processes_in(inodes), "ranks_alive": alive}


def _fault_once(kind: str, nodes: int, timeout: float, link: str = "1gbit") -> dict:
    """One run of ``steps_on_rank`` on ``nodes`` nodes with node ``nodes - 1`` cut or killed at
    step 3: seconds from the fault to the error, whether every rank's line names the node and
    the collective, and what was left behind."""
    lost = nodes - 1
    cluster = EmulatedCluster(nodes, link=link, collective_timeout=timeout).start()
    pids: set[int] = set()
    result: dict = {"nodes": nodes}
    try:
        pids |= {r["pid"] for r in run_ranks(steps_on_rank, nodes, 2, cluster=cluster)}
        fault = (cluster.cut_link if kind == "cut" else cluster.kill_node)(lost,
                                                                           at_step=FAULT_STEP)
        start = time.monotonic()
        try:
            run_ranks(steps_on_rank, nodes, 60, cluster=cluster, timeout=timeout + 60)
            result["error"] = None
        except RankError as exc:
            ended = time.monotonic()
            story = str(exc).split("\n\nThe first error")[0]
            lines = [ln.strip() for ln in story.splitlines() if ln.startswith("  rank ")]
            result.update(
                seconds_to_error=ended - fault.applied_at,
                seconds_of_run=ended - start,
                lost_nodes=getattr(exc, "lost_nodes", []),
                every_rank_reported=len(lines) == nodes,
                names_node=story.startswith(f"node {lost} "),
                survivors_name_collective=all("in all_reduce" in ln for ln in lines
                                              if "lost" not in ln.split(":")[0]),
                report=story,
            )
    finally:
        result["left"] = _closed_clean(cluster, pids)
    return result


def _restore_once(nodes: int, outage: float, timeout: float, link: str = "1gbit") -> dict:
    """Node ``nodes - 1``'s link cut at step 3 and restored ``outage`` seconds later, within a
    collective timeout of ``timeout``: the outage and the longest step around it."""
    cluster = EmulatedCluster(nodes, link=link, collective_timeout=timeout).start()
    pids: set[int] = set()
    try:
        pids |= {r["pid"] for r in run_ranks(steps_on_rank, nodes, 2, cluster=cluster)}
        cut = cluster.cut_link(nodes - 1, at_step=FAULT_STEP)

        def outage_over() -> bool:
            return cut.applied_at is not None and time.monotonic() > cut.applied_at + outage

        restore = cluster.restore_link(nodes - 1, when=outage_over)
        results = run_ranks(steps_on_rank, nodes, 8, cluster=cluster, timeout=timeout + 60)
        pids |= {r["pid"] for r in results}
        stall = max(r["inside"][FAULT_STEP] for r in results)
        after = max(max(r["inside"][FAULT_STEP + 1:]) for r in results)
        return {"nodes": nodes, "outage": restore.applied_at - cut.applied_at,
                "stalled_step": stall, "slowest_step_after": after,
                "left": _closed_clean(cluster, pids)}
    except BaseException:
        _closed_clean(cluster, pids)
        raise


def straggler(nodes: int, link: str, slow_rate: str, grad_bytes: int, compute_s: float,
              steps: int = 8) -> dict:
    """A straggler node: each rank's medians before and inside the all-reduce of ``grad_bytes``
    at the cluster's ``link`` and with node ``nodes - 1`` slowed to ``slow_rate``, beside
    chapter 10's step-time model (:func:`dpcourse.cost.scaling.step_time`, no overlap, the
    alpha left out) at each rate."""
    numel = grad_bytes // 4
    with EmulatedCluster(nodes, link=link) as cluster:
        run_ranks(steps_on_rank, nodes, 2, numel, cluster=cluster)
        fast = run_ranks(steps_on_rank, nodes, steps, numel, compute_s, cluster=cluster)
        cluster.slow_link(nodes - 1, slow_rate)
        slow = run_ranks(steps_on_rank, nodes, steps, numel, compute_s, cluster=cluster)
    out: dict = {"nodes": nodes, "link": link, "slow_rate": slow_rate, "grad_bytes": grad_bytes,
                 "compute_s": compute_s}
    for name, runs, rate in (("full", fast, link), ("slowed", slow, slow_rate)):
        beta = rate_bits(rate) / 8
        out[name] = {
            "before": [statistics.median(r["before"][1:]) for r in runs],
            "inside": [statistics.median(r["inside"][1:]) for r in runs],
            "step": [statistics.median(b + i for b, i in zip(r["before"][1:], r["inside"][1:],
                                                             strict=True)) for r in runs],
            "model_step": scaling.step_time(nodes, compute_s, grad_bytes, 0.0, beta),
        }
    return out


def run(args: argparse.Namespace) -> dict:
    result: dict = {"timeout": args.timeout, "fault_step": FAULT_STEP, "link": args.link}
    for kind in ("cut", "kill"):
        if kind in args.what:
            result[kind] = [_fault_once(kind, n, args.timeout, args.link)
                            for n in args.nodes for _ in range(args.repeats)]
    if "restore" in args.what:
        result["restore"] = [_restore_once(n, args.outage, max(10.0, 5 * args.outage),
                                          args.link) for n in args.nodes]
    if "slow" in args.what:
        result["slow"] = [straggler(n, args.link, args.slow_rate, args.grad_bytes,
                                    args.compute_ms / 1e3) for n in args.nodes]
    return result


def _clean(left: dict) -> bool:
    return not (left["names"] or left["in_nodes"] or left["ranks_alive"])


def report(result: dict) -> None:
    for kind in ("cut", "kill"):
        runs = result.get(kind, [])
        for nodes in sorted({r["nodes"] for r in runs}):
            mine = [r for r in runs if r["nodes"] == nodes]
            ended = [r["seconds_to_error"] for r in mine if "seconds_to_error" in r]
            named = sum(r.get("names_node", False) and r.get("every_rank_reported", False)
                        and r.get("survivors_name_collective", False) for r in mine)
            clean = sum(_clean(r["left"]) for r in mine)
            print(f"{kind} on {nodes} nodes, {len(mine)} runs: error in {len(ended)}, "
                  f"{min(ended, default=0):.2f}-{max(ended, default=0):.2f} s after the fault "
                  f"(median {statistics.median(ended) if ended else 0:.2f}; collective timeout "
                  f"{result['timeout']:g} s); node and collective named in {named}; nothing "
                  f"left in {clean}")
    for r in result.get("restore", []):
        print(f"restore on {r['nodes']} nodes: cut for {r['outage']:.2f} s, the step that met it "
              f"took {r['stalled_step']:.2f} s, the slowest after it {r['slowest_step_after']:.3f}"
              f" s; nothing left: {_clean(r['left'])}")
    for r in result.get("slow", []):
        print(f"straggler node on {r['nodes']} nodes ({r['grad_bytes'] / 2**20:g} MiB, "
              f"{r['compute_s'] * 1e3:g} ms of compute per step):")
        for name, rate in (("full", r["link"]), ("slowed", r["slow_rate"])):
            s = r[name]
            print(f"  node {r['nodes'] - 1} at {rate:>8}: step "
                  + ", ".join(f"{t * 1e3:.1f}" for t in s["step"]) + " ms by rank (model "
                  f"{s['model_step'] * 1e3:.1f}); before the all-reduce "
                  + ", ".join(f"{t * 1e3:.1f}" for t in s["before"]) + " ms, inside "
                  + ", ".join(f"{t * 1e3:.1f}" for t in s["inside"]) + " ms")
