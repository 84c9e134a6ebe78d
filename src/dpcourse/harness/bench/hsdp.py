"""``python -m dpcourse.harness.bench hsdp``: DDP, FSDP and HSDP step times on an emulated cluster
of nodes joined by a slow link, beside the alpha-beta model.

``nodes`` emulated machines (:mod:`dpcourse.harness.cluster`) of ``ranks_per_node`` ranks each:
the link between nodes shaped to each rate of ``rates`` in turn, the loopback inside a node left
at memory speed (or shaped to ``node_link``). On each, the course's own three, on the course's
rings: DDP (every parameter replicated, the gradients averaged by one ring all-reduce after
backward: chapter 9's :class:`~dpcourse.sharding.fsdp.FSDP` with no sharded layer), FSDP over
every rank and chapter 11's :class:`~dpcourse.sharding.hsdp.HSDP`, training the same MLP with
Adam, steps
interleaved, the slowest rank's time, medians; and a step of the model alone, with no
communication (its compute). Each step's bytes are counted per link (to a rank of the same node
or of another). The model: that compute plus :func:`dpcourse.sharding.hsdp.step_comm_time`
with each link's latency and bandwidth measured by ping-pong messages (the bandwidth fitted on
1 MiB and more, the latency a 4 KiB message's one-way time), for the emulated nodes (one network
link that a node's ranks share) and for DGX-style ones (a card per GPU). Needs root (or
CAP_NET_ADMIN).

Chapter 11: DDP, FSDP and HSDP measured across emulated nodes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.collectives import count_traffic, ring_all_reduce
from dpcourse.collectives.hierarchical import node_groups
from dpcourse.cost import hardware
from dpcourse.harness.bench.cluster import fit_link_on_cluster
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch import run_ranks
from dpcourse.sharding import hsdp
from dpcourse.sharding.fsdp import FSDP

__all__ = ["STRATEGIES", "make_mlp", "steps_on_rank", "measure_rate", "measure_strategies",
           "model_times"]

HELP = "DDP, FSDP and HSDP step times on emulated nodes with a slow link between them"
STRATEGIES = ("ddp", "fsdp", "hsdp")
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "hsdp": "HSDP"}


def make_mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` Linear ``width`` x ``width`` layers with ReLU between, seeded."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _wrap(strategy: str, model: nn.Module, ranks_per_node: int, groups):
    """(module, what finishes a step's gradients) for ``strategy`` or "compute" (no wrapper)."""
    if strategy == "ddp":  # every parameter replicated: one ring all-reduce after backward
        ddp = FSDP(model, layers=[])
        return ddp, ddp.finish_gradient_synchronization
    if strategy == "fsdp":
        fsdp = FSDP(model)
        return fsdp, fsdp.finish_gradient_synchronization
    if strategy == "hsdp":
        wrapped = hsdp.HSDP(model, ranks_per_node, groups=groups)
        return wrapped, wrapped.finish_gradient_synchronization
    return model, lambda: None


def _link_bytes(traffic, ranks_per_node: int) -> dict[str, int]:
    node = dist.get_rank() // ranks_per_node
    sent = {"inside": 0, "across": 0}
    for kind, peer, nbytes in traffic.log:
        if kind == "send":
            sent["inside" if peer // ranks_per_node == node else "across"] += nbytes
    return sent


def _link(cluster, peer: int, inside: bool) -> tuple[float, float]:
    """(alpha, beta) of the link from rank 0 to rank ``peer``: beta fitted on ping-pong messages
    of 1 MiB and more (up to 4 MiB across nodes, 16 MiB inside one, whose loopback moves 4 MiB in
    about a millisecond, as long as a wait for a core), alpha the one-way time of a 4 KiB
    message. (The fit's own alpha, what the smallest message took beyond its bytes at beta, is
    about 0 on a shaped link: tbf lets a message smaller than its bucket through at once. The
    4 KiB message's time is the fixed cost a message pays here: the software's, and waiting for
    a core on a busy machine.)"""
    sizes = [2**20, 2**22, 2**23, 2**24] if inside else [2**16, 2**18, 2**20]
    _, beta, sizes, one_way = fit_link_on_cluster(cluster, sizes, peer=peer)
    return one_way[sizes.index(2**12)], beta


def steps_on_rank(ranks_per_node: int, width: int, layers: int, batch: int, steps: int,
                  warmup: int) -> dict:
    """Runs on every rank: median step seconds (the slowest rank's) of DDP, FSDP, HSDP and the
    model alone ("compute"), their steps interleaved, and the bytes this rank sent in one step
    of each, to ranks of its node and of others."""
    torch.set_num_threads(1)
    groups = node_groups(ranks_per_node)  # a collective: every rank, once, up front
    base = make_mlp(width, layers)
    runs = {}
    for name in ("compute", *STRATEGIES):
        module, finish = _wrap(name, copy.deepcopy(base), ranks_per_node, groups)
        runs[name] = (module, finish, torch.optim.Adam(module.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    times: dict[str, list[float]] = {name: [] for name in runs}
    sent: dict[str, dict[str, int]] = {}
    for i in range(warmup + steps):
        for name, (module, finish, opt) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            with count_traffic() as traffic:
                opt.zero_grad()
                nn.functional.mse_loss(module(x), y).backward()
                finish()
                opt.step()
            seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            ring_all_reduce(seconds, "max", check_shapes=False)  # the slowest rank's
            if i >= warmup:
                times[name].append(float(seconds))
            sent[name] = _link_bytes(traffic, ranks_per_node)
    for module, _, _ in runs.values():
        if isinstance(module, FSDP):
            module.close()
    return {"median": {name: statistics.median(t) for name, t in times.items()},
            "times": times, "sent": sent}


def model_times(result: dict, nics_per_node: int = 1) -> dict[str, float]:
    """The modelled step seconds of each strategy for one measured rate: its measured compute
    plus :func:`dpcourse.sharding.hsdp.step_comm_time` with the fitted links."""
    intra = hardware.Link("inside a node (fitted)", *result["intra"], "ping-pong")
    inter = hardware.Link("between nodes (fitted)", *result["inter"], "ping-pong")
    compute = result["measured"]["compute"]
    return {s: compute + hsdp.step_comm_time(
        s, result["params"], result["nodes"], result["ranks_per_node"], intra, inter,
        nics_per_node=nics_per_node, layers=result["layers"]) for s in STRATEGIES}


def measure_rate(rate: str, nodes: int = 2, ranks_per_node: int = 2,
                 node_link: str | None = None, width: int = 256, layers: int = 4,
                 batch: int = 32, steps: int = 5, warmup: int = 1) -> dict:
    """One link rate: fit both links, time the three strategies, model them."""
    k, world = ranks_per_node, nodes * ranks_per_node
    with EmulatedCluster(nodes, k, link=rate, node_link=node_link) as cluster:
        inter, intra = _link(cluster, k, inside=False), _link(cluster, 1, inside=True)
        per_rank = run_ranks(steps_on_rank, world, k, width, layers, batch, steps, warmup,
                             cluster=cluster, timeout=1800)
    across = {s: [sum(r["sent"][s]["across"] for r in per_rank[n * k:(n + 1) * k])
                  for n in range(nodes)] for s in STRATEGIES}
    result = {"rate": rate, "rate_bits": hardware.rate_bits(rate), "nodes": nodes,
              "ranks_per_node": k, "node_link": node_link, "width": width, "layers": layers,
              "batch": batch, "params": layers * (width * width + width),
              "inter": inter, "intra": intra, "measured": per_rank[0]["median"],
              "times": per_rank[0]["times"], "across_per_node": across}
    result["model"] = model_times(result)
    result["model_card_per_gpu"] = model_times(result, nics_per_node=k)
    return result


def measure_strategies(rates: Sequence[str] = ("100mbit", "400mbit", "1gbit", "4gbit"),
                       **kwargs) -> dict:
    """:func:`measure_rate` for every rate of ``rates`` (an emulated cluster each)."""
    return {"runs": [measure_rate(rate, **kwargs) for rate in rates]}


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", nargs="+", default=["100mbit", "400mbit", "1gbit", "4gbit"],
                        help="links between nodes, as tc writes them")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--node-link", default=None, help="inside a node (default: unshaped)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    return measure_strategies(args.rates, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                              node_link=args.node_link, width=args.width, layers=args.layers,
                              batch=args.batch, steps=args.steps)


def report(result: dict) -> None:
    first = result["runs"][0]
    print(f"{first['nodes']} emulated nodes x {first['ranks_per_node']} ranks, MLP "
          f"{first['layers']} x {first['width']} ({first['params']:,} parameters, fp32), "
          f"Adam, batch {first['batch']} per rank; medians of the slowest rank, ms (model)")
    print(f"{'between nodes':>14} {'fitted':>10} {'compute':>8} " + " ".join(
        f"{LABELS[s]:>16}" for s in STRATEGIES) + "  MiB across per node: DDP FSDP HSDP")
    for run_ in result["runs"]:
        m, model = run_["measured"], run_["model"]
        across = " ".join(f"{run_['across_per_node'][s][0] / 2**20:.2f}" for s in STRATEGIES)
        print(f"{run_['rate']:>14} {run_['inter'][1] * 8 / 1e6:7.0f} Mb {m['compute'] * 1e3:8.1f} "
              + " ".join(f"{m[s] * 1e3:7.1f} ({model[s] * 1e3:6.1f})" for s in STRATEGIES)
              + f"  {across}")
