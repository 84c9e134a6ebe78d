"""ZeRO's optimizer state on disk: one rank's shard, or the whole state (chapter 9).

A :class:`~dpcourse.sharding.zero.ShardedOptimizer` saves a **sharded checkpoint**: each rank
writes the state of its own slices (``state_dict()``), with the layout they belong to (each
parameter's place and shape). :func:`consolidate` gathers the slices into the ``state_dict`` that an
unsharded optimizer of the same class would have, for a single process to load, as torch's
``ZeroRedundancyOptimizer.consolidate_state_dict`` does; :func:`merge_sharded` builds the same
from every rank's file, without a process group. :func:`load` takes any of them back: this
rank's own file as it is; a full state (a plain optimizer's, from chapter 8's checkpoints, or a
consolidated one) cut to this rank's shard; every rank's files of a run on another number of
ranks, merged and cut again. The state is keyed by the flat shard, so the values that are not
tensors of the parameter's shape, Adam's step counter, are one per shard: where a full state
has different ones for the parameters of a shard, the shard takes the largest.

Chapter 9: sharded checkpoints and consolidating them.
"""

from __future__ import annotations

from typing import Any

import torch

from dpcourse.collectives.ring import ring_all_gather_
from dpcourse.sharding.flat_shards import FlatGroup

__all__ = ["ShardedStateDict", "layout", "check_sharded_checkpoint", "gather_shard_state",
           "consolidate", "merge_sharded", "load", "shard_state_from_full"]


class ShardedStateDict:
    """The state methods of :class:`~dpcourse.sharding.zero.ShardedOptimizer` (a mixin)."""

    reshards_state = True  # chapter 8's load_checkpoint: it takes every rank's files as a list

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, group numel) of this rank's shard in each group's flat buffer."""
        return [(g.start, g.end, g.numel) for g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: the inner optimizer's state (its shards)
        and the layout it belongs to. Save one file per rank."""
        return {"optimizer": self.optimizer.state_dict(), "layout": layout(self)}

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Resume from this rank's :meth:`state_dict`; from a list of every rank's (saved on
        any number of ranks); or from a full state, such as an unsharded ``optimizer_cls``'s
        over the same parameters and groups (or :meth:`consolidate_state_dict`'s). Anything
        else is refused, saying what to load instead (:func:`load`)."""
        self.optimizer.load_state_dict(load(self, state_dict))
        self.param_groups = self.optimizer.param_groups  # torch's load makes new groups
        self.state = self.optimizer.state

    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state on rank ``to`` (None on the others; every rank must call
        it): the ``state_dict`` of an unsharded ``optimizer_cls`` over the same parameters and
        groups, which a single process can load; as ``ZeroRedundancyOptimizer``'s."""
        return consolidate(self, to)


def layout(opt: Any) -> dict[str, Any]:
    """Where ``opt``'s shards are: its rank, world size, stage and each group's bounds."""
    return {
        "rank": opt.rank,
        "world_size": opt.world_size,
        "stage": opt.stage,
        "numels": [g.numel for g in opt._groups],
        "shards": [(g.start, g.end) for g in opt._groups],
        # each trainable parameter: its index in its group (frozen ones counted), place, shape
        "params": [[(i, s, e, list(p.shape)) for i, p, (s, e)
                    in zip(_positions(all_params), g.params, g.offsets, strict=True)]
                   for g, all_params in zip(opt._groups, opt._all_params, strict=True)],
        "group_sizes": [len(ps) for ps in opt._all_params],
    }


def _positions(params: list[torch.Tensor]) -> list[int]:
    """Where each trainable parameter of a group is among all its parameters."""
    return [i for i, p in enumerate(params) if p.requires_grad]


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
            f"{opt.world_size} with groups of {mine['numels']}. Load this rank's own file, "
            "or, to resume on another number of ranks, the list of every rank's files "
            "(opt.load_state_dict([torch.load(f) for f in files]), on every rank) or a "
            "consolidated state (consolidate_state_dict); the model must be the same"
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


# ----------------------------------------------------------------------- loading, resharding
def _is_full(state_dict: Any) -> bool:
    return isinstance(state_dict, dict) and {"state", "param_groups"} <= set(state_dict)


def load(opt: Any, state_dict: Any) -> dict[str, Any]:
    """The inner optimizer's ``state_dict`` for this rank of ``opt``, from what
    ``opt.load_state_dict`` was given: this rank's sharded checkpoint (checked to be its own),
    a list of every rank's (merged, :func:`merge_sharded`) or a full state (a torch
    optimizer's ``state_dict`` over the same parameters and groups), cut to this rank's shard
    (:func:`shard_state_from_full`). Anything else raises ``ValueError``, saying what to load."""
    if isinstance(state_dict, list | tuple):
        return shard_state_from_full(opt, merge_sharded(list(state_dict)))
    if _is_full(state_dict):
        return shard_state_from_full(opt, state_dict)
    if isinstance(state_dict, dict) and "layout" in state_dict:
        check_sharded_checkpoint(opt, state_dict)
        return state_dict["optimizer"]
    raise ValueError(
        "not an optimizer state: load what ShardedOptimizer.state_dict() returned on this rank, "
        "the list of every rank's, or a torch optimizer's state_dict() over the same parameters "
        f"(keys 'state' and 'param_groups'); got {type(state_dict).__name__}"
        + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
    )


def shard_state_from_full(opt: Any, full: dict[str, Any]) -> dict[str, Any]:
    """Cut a full state (a torch optimizer's ``state_dict``: per parameter index, over the
    parameters and groups ``opt`` was given, frozen ones included) to this rank's shards: the
    inner optimizer's ``state_dict``. Values of a parameter's shape are sliced; the others (a
    step counter) are one per shard, the largest of its parameters'. A parameter without state
    leaves zeros in its slices (a fresh state's values)."""
    sizes = [len(ps) for ps in opt._all_params]
    saved_sizes = [len(g["params"]) for g in full["param_groups"]]
    if saved_sizes != sizes:
        raise ValueError(
            f"this state is of {len(saved_sizes)} parameter group(s) of {saved_sizes} parameters; "
            f"this optimizer has {len(sizes)} of {sizes}. Build the optimizer over the same "
            "parameters, in the same groups and order, as the one that saved it (frozen "
            "parameters included if they were given to it)"
        )
    inner_state, groups = {}, []
    for k, (g, all_params, saved) in enumerate(zip(opt._groups, opt._all_params,
                                                   full["param_groups"], strict=True)):
        shard: dict[str, Any] = {}
        for i, p, (s, e) in zip(_positions(all_params), g.params, g.offsets, strict=True):
            a, b = max(s, g.start), min(e, g.end)
            st = full["state"].get(saved["params"][i])
            if a >= b or not st:
                continue
            for key, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    if v.numel() != p.numel():
                        raise ValueError(
                            f"state {key!r} of parameter {i} of group {k} has shape "
                            f"{tuple(v.shape)}, the parameter {tuple(p.shape)}: only "
                            "elementwise optimizers' states can be sharded"
                        )
                    if key not in shard:
                        shard[key] = torch.zeros(g.end - g.start, dtype=v.dtype, device=v.device)
                    shard[key][a - g.start : b - g.start] = v.reshape(-1)[a - s : b - s]
                elif key not in shard or _larger(v, shard[key]):
                    shard[key] = v.clone() if torch.is_tensor(v) else v
        if shard:
            inner_state[k] = shard
        groups.append({**{o: v for o, v in saved.items() if o != "params"}, "params": [k]})
    return {"state": inner_state, "param_groups": groups}


def _larger(a: Any, b: Any) -> bool:
    try:
        return float(a) > float(b)
    except (TypeError, ValueError):
        return False


def merge_sharded(state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The full state (a torch optimizer's ``state_dict`` over all the parameters, frozen
    ones included) from the sharded checkpoints of **every** rank of a run, in any order; no
    process group needed. Refuses a list that is not one run's ranks 0 to N-1."""
    for sd in state_dicts:
        if not (isinstance(sd, dict) and "layout" in sd and "params" in sd["layout"]):
            raise ValueError("expected every rank's ShardedOptimizer.state_dict(), one each")
    by_rank = {sd["layout"]["rank"]: sd for sd in state_dicts}
    world = state_dicts[0]["layout"]["world_size"] if state_dicts else 0
    if sorted(by_rank) != list(range(world)) or len(state_dicts) != world or any(
        sd["layout"]["numels"] != state_dicts[0]["layout"]["numels"] for sd in state_dicts
    ):
        ranks = sorted(sd["layout"]["rank"] for sd in state_dicts)
        raise ValueError(
            f"expected the checkpoints of ranks 0 to {world - 1} of one run, one each; got "
            f"ranks {ranks}: load every rank's file of the same step"
        )
    first = by_rank[0]["layout"]
    state, groups, index = {}, [], 0
    for k, (params, size) in enumerate(zip(first["params"], first["group_sizes"], strict=True)):
        shards = [(by_rank[r]["layout"]["shards"][k], by_rank[r]["optimizer"]["state"].get(k, {}))
                  for r in range(world)]
        flat: dict[str, torch.Tensor] = {}
        for (start, end), st in shards:
            for key, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    if key not in flat:
                        flat[key] = torch.zeros(first["numels"][k], dtype=v.dtype, device=v.device)
                    flat[key][start:end] = v
        for i, s, e, shape in params:
            covering = [st for (start, end), st in shards if st and start < e and s < end]
            if covering:
                st = {key: t[s:e].view(shape).clone() for key, t in flat.items()}
                for other in covering:
                    for key, v in other.items():
                        if key not in flat and (key not in st or _larger(v, st[key])):
                            st[key] = v.clone() if torch.is_tensor(v) else v
                state[index + i] = st
        options = by_rank[0]["optimizer"]["param_groups"][k]
        groups.append({**{o: v for o, v in options.items() if o != "params"},
                       "params": list(range(index, index + size))})
        index += size
    return {"state": state, "param_groups": groups}
