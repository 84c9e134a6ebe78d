"""ZeRO's optimizer state on disk: one rank's shard, or the whole state gathered (chapter 9).

A :class:`~dpcourse.zero.ShardedOptimizer` saves a **sharded checkpoint**: each rank writes the
state of its own slices (``state_dict()``), with the layout they belong to, and can load only
its own file back, on the same world size (:func:`check_sharded_checkpoint` says why another one
does not fit). :func:`consolidate` gathers the slices into the ``state_dict`` that an unsharded
optimizer of the same class would have, for a single process to load, as torch's
``ZeroRedundancyOptimizer.consolidate_state_dict`` does.

Chapter 9: sharded checkpoints and consolidating them.
"""

from __future__ import annotations

from typing import Any

import torch

from dpcourse.collectives.ring import ring_all_gather_
from dpcourse.flat_shards import FlatGroup

__all__ = ["layout", "check_sharded_checkpoint", "gather_shard_state", "consolidate"]


def layout(opt: Any) -> dict[str, Any]:
    """Where ``opt``'s shards are: its rank, world size, stage and each group's bounds."""
    return {
        "rank": opt.rank,
        "world_size": opt.world_size,
        "stage": opt.stage,
        "numels": [g.numel for g in opt._groups],
        "shards": [(g.start, g.end) for g in opt._groups],
    }


def check_sharded_checkpoint(opt: Any, state_dict: dict[str, Any]) -> None:
    """Raise ``ValueError``, saying what to load instead, unless ``state_dict`` is what
    ``opt.state_dict()`` returned on this rank of a job of the same size and model."""
    if "layout" not in state_dict or "optimizer" not in state_dict:
        raise ValueError(
            "not a ShardedOptimizer checkpoint (expected the keys 'optimizer' and "
            "'layout'): load what ShardedOptimizer.state_dict() returned on this rank"
        )
    saved, mine = state_dict["layout"], layout(opt)
    if saved != mine:
        raise ValueError(
            f"this checkpoint belongs to rank {saved['rank']} of {saved['world_size']} "
            f"with groups of {saved['numels']} elements; this is rank {opt.rank} of "
            f"{opt.world_size} with groups of {mine['numels']}. Load each rank's own file "
            "on the same world size and model (resharding is not supported)"
        )


def gather_shard_state(
    group: FlatGroup, shard_state: dict[str, Any], rank: int, world_size: int
) -> dict[int, dict[str, Any]]:
    """An optimizer's state for ``group.shard`` (``exp_avg``, ...), gathered from every rank
    (a ring all-gather; every rank must call it) and cut back into one dict per trainable
    parameter, keyed by ``id(param)``, each tensor shaped like its parameter. Values that are
    not slices of the shard (Adam's ``step``) are copied. Chapter 9: consolidating ZeRO's state.
    """
    whole = {}
    for key in sorted(shard_state):
        value = shard_state[key]
        if torch.is_tensor(value) and value.dim() == 1 and value.shape == group.shard.shape:
            full = torch.zeros(group.numel, dtype=value.dtype, device=value.device)
            full[group.start : group.end] = value
            if world_size > 1 and group.numel > 0:
                ring_all_gather_(full.tensor_split(world_size), rank)
            whole[key] = full
    out = {}
    for p, (s, e) in zip(group.params, group.offsets, strict=True):
        if shard_state:
            out[id(p)] = {
                k: whole[k][s:e].view_as(p).clone() if k in whole
                else (v.clone() if torch.is_tensor(v) else v)
                for k, v in shard_state.items()
            }
    return out


@torch.no_grad()
def consolidate(opt: Any, to: int = 0) -> dict[str, Any] | None:
    """``opt.consolidate_state_dict(to)``: on rank ``to`` the ``state_dict`` of an unsharded
    ``opt.optimizer_cls`` over the parameters and groups ``opt`` was given (frozen ones
    included, without state); None on the other ranks. Every rank must call it."""
    if not 0 <= to < opt.world_size:
        raise ValueError(f"to must be a rank from 0 to {opt.world_size - 1}, got {to}")
    state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for g, params, inner in zip(opt._groups, opt._all_params, opt.param_groups, strict=True):
        per_param = gather_shard_state(g, opt.state.get(g.shard, {}), opt.rank, opt.world_size)
        ids = list(range(index, index + len(params)))
        for i, p in zip(ids, params, strict=True):
            if id(p) in per_param:
                state[i] = per_param[id(p)]
        index += len(params)
        groups.append({**{k: v for k, v in inner.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups} if opt.rank == to else None
