"""Sharded optimizers from scratch: ZeRO stages 1 and 2 (chapter 9).

Plain data parallelism keeps the whole optimizer state on every rank: N identical copies of
Adam's two moments. :class:`ShardedOptimizer` keeps 1/N of it on each rank (Rajbhandari et al.,
2020). For each parameter group the trainable parameters are laid end to end in one flat buffer,
and the parameters become views into it. Rank r **owns** the contiguous slice
``chunk_bounds(numel, N)[r]`` of that buffer, the very chunk that the ring reduce-scatter of
chapter 6 leaves fully reduced on rank r. One step is then

1. copy the gradients into a flat gradient buffer of the same layout;
2. **reduce-scatter** it with our ring: rank r ends with the sum of its slice, divided by N
   (gradients are averaged, as in DDP);
3. step the slice with any elementwise torch optimizer (SGD, Adam, AdamW, ...): its state is
   created for the slice only;
4. **all-gather** the updated slices in place, so that every rank holds all the parameters again.

Reduce-scatter plus all-gather move as many bytes as one ring all-reduce, so stage 1 costs no
more communication than DDP. Stage 2 also frees the full gradients after step 2 and keeps only
the rank's shard of them.

Flat sharding splits tensors across ranks, so every rank's share is 1/N of the elements to within
one. Optimizers that look at a whole tensor at once (LAMB's or Adafactor's per-tensor norms) would
see slices instead; ``torch.distributed.optim.ZeroRedundancyOptimizer`` gives whole tensors to
ranks instead, which keeps such optimizers exact but balances the state less evenly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpcourse.collectives.ops import chunk_bounds
from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import _all_gather_, _reduce_scatter_
from dpcourse.collectives.tree import tree_broadcast

__all__ = [
    "ShardedOptimizer",
    "shard_bounds",
    "owner_of",
    "optimizer_state_bytes",
    "record_collectives",
    "fsdp_step_events",
    "VARIANTS",
    "make_variant",
    "train_variants_on_rank",
]


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, end) of the slice of a flat buffer of ``numel`` elements that ``rank`` owns.

    The same chunks as the ring reduce-scatter (:func:`~dpcourse.collectives.ops.chunk_bounds`):
    the first ``numel % world_size`` ranks own one element more. Chapter 9's first exercise.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} of {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return chunk_bounds(numel, world_size)[rank]


def owner_of(index: int, numel: int, world_size: int) -> int:
    """The rank that owns element ``index`` of a flat buffer of ``numel`` elements."""
    if not 0 <= index < numel:
        raise IndexError(f"index {index} is outside a buffer of {numel} elements")
    base, extra = divmod(numel, world_size)
    # The first `extra` ranks own base + 1 elements each, the others base.
    if index < extra * (base + 1):
        return index // (base + 1)
    return extra + (index - extra * (base + 1)) // base


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in ``optimizer.state`` (a torch optimizer or a ShardedOptimizer):
    what this rank keeps for the optimizer, measured, not estimated."""
    state = optimizer.state
    return sum(
        t.nbytes
        for per_param in state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )


@dataclass
class _FlatGroup:
    """One parameter group laid out flat: the buffers and where this rank's shard is."""

    params: list[nn.Parameter]
    offsets: list[tuple[int, int]]  # each parameter's (start, end) in the flat buffer
    flat: torch.Tensor  # every trainable parameter of the group, end to end
    grad: torch.Tensor | None  # flat gradient buffer (stage 1: kept; stage 2: per step)
    start: int
    end: int
    shard: nn.Parameter  # flat[start:end], the slice this rank steps

    @property
    def numel(self) -> int:
        return self.flat.numel()


def _into_flat(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: move the parameter's fresh gradient into ``view`` (its
    place in the flat gradient buffer) and make ``.grad`` that view, so that the gradient is
    held once, as DDP's ``gradient_as_bucket_view`` does (chapter 7). Later backward passes
    then accumulate straight into the buffer."""

    def hook(param: torch.Tensor) -> None:
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    return hook


class ShardedOptimizer:
    """ZeRO stage 1 (or 2): each rank keeps the optimizer state of 1/N of the parameters.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``
    on every rank of a process group replaces both DDP's gradient all-reduce and the optimizer:
    call ``loss.backward()`` then ``step()``. ``params`` is what a torch optimizer takes: an
    iterable of parameters, or of dicts (parameter groups, each with its own options such as
    ``lr`` or ``weight_decay``). Parameters that do not require gradients are left out (frozen).
    All of a rank's trainable parameters must be on one device, and those of a group of one
    dtype; every rank must pass the same parameters in the same order.

    ``stage=1`` shards the optimizer state and keeps one flat gradient buffer per group, which
    the model's ``.grad`` become views of during backward (a hook moves each gradient there as
    it is produced); ``stage=2`` keeps only this rank's shard of the gradients (the full ones
    are freed after the reduce-scatter). After ``step`` every ``p.grad`` is ``None``.
    ``broadcast_parameters`` (default) copies rank 0's parameters to every rank at
    construction, so that the replicas start equal, as DDP does.

    The parameters become views into one flat buffer per group (their ``.data`` is replaced;
    values are kept). A parameter without a gradient at ``step`` counts as a zero gradient.
    Gradients are averaged inside ``step``, so code that reads ``.grad`` between backward and
    ``step`` (gradient clipping, say) sees this rank's own gradients, not the average that DDP
    would show. For a learning-rate scheduler, pass it the inner torch optimizer,
    ``sharded.optimizer``.
    ``state_dict()`` is this rank's shard (a sharded checkpoint); load it on the same rank of
    the same world size. Chapter 9.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        stage: int = 1,
        broadcast_parameters: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 (shard the optimizer state) or 2 (and the gradients), got "
                f"{stage!r}; for stage 3 use torch.distributed.fsdp.fully_shard"
            )
        is_class = isinstance(optimizer_cls, type)
        if not (is_class and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                "optimizer_cls must be a torch optimizer class such as torch.optim.AdamW (the "
                f"class, not an instance), got {optimizer_cls!r}"
            )
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        self.stage = stage
        self.optimizer_cls = optimizer_cls
        groups = _as_groups(params)
        trainable = [p for g in groups for p in g["params"] if p.requires_grad]
        if not trainable:
            raise ValueError(
                "ShardedOptimizer got no trainable parameters: pass model.parameters() (after "
                "moving the model to its device), and check that not every parameter is frozen"
            )
        devices = sorted({str(p.device) for p in trainable})
        if len(devices) > 1:
            raise ValueError(
                f"the parameters are on several devices ({', '.join(devices)}): a rank's "
                "parameters must all be on one device; move the model there first, e.g. "
                "model.to(dpcourse.runtime.device())"
            )
        self.device = trainable[0].device

        self._groups: list[_FlatGroup] = []
        inner_groups = []
        for i, group in enumerate(groups):
            params_g = [p for p in group["params"] if p.requires_grad]
            dtypes = sorted({str(p.dtype) for p in params_g})
            if len(dtypes) > 1:
                raise ValueError(
                    f"parameter group {i} mixes dtypes ({', '.join(dtypes)}): one flat buffer "
                    "holds one dtype; put the parameters of each dtype in a group of their own"
                )
            flat_group = self._flatten(params_g, broadcast_parameters)
            self._groups.append(flat_group)
            options = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({"params": [flat_group.shard], **options})
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)

    # --------------------------------------------------------------------------- layout
    def _flatten(self, params: list[nn.Parameter], broadcast: bool) -> _FlatGroup:
        dtype = params[0].dtype if params else torch.float32
        numel = sum(p.numel() for p in params)
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        offsets, start = [], 0
        for p in params:
            end = start + p.numel()
            flat[start:end].copy_(p.detach().reshape(-1))
            offsets.append((start, end))
            start = end
        if broadcast and self.world_size > 1 and numel > 0:
            tree_broadcast(flat, src=0)
        for p, (s, e) in zip(params, offsets, strict=True):
            p.data = flat[s:e].view_as(p)  # the parameter now lives in the flat buffer
        s0, s1 = shard_bounds(numel, self.world_size, self.rank)
        shard = nn.Parameter(flat[s0:s1])  # a view: stepping it updates flat in place
        grad = torch.zeros_like(flat) if self.stage == 1 else None
        shard.grad = grad[s0:s1] if grad is not None else torch.zeros_like(flat[s0:s1])
        if grad is not None:
            for p, (s, e) in zip(params, offsets, strict=True):
                p.register_post_accumulate_grad_hook(_into_flat(grad[s:e].view_as(p)))
        return _FlatGroup(params, offsets, flat, grad, s0, s1, shard)

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Average the gradients over the ranks (reduce-scatter), step this rank's shard,
        and all-gather the updated shards, so that every rank has every parameter again."""
        if closure is not None:
            raise ValueError(
                "ShardedOptimizer.step does not take a closure (LBFGS-style "
                "optimizers re-evaluate the whole model, which it cannot shard)"
            )
        for g in self._groups:
            if g.numel == 0:
                continue
            flat_grad = g.grad if g.grad is not None else torch.empty_like(g.flat)
            for p, (s, e) in zip(g.params, g.offsets, strict=True):
                if p.grad is None:
                    flat_grad[s:e].zero_()
                elif p.grad.data_ptr() != flat_grad[s:e].data_ptr():  # not moved by the hook
                    flat_grad[s:e].copy_(p.grad.reshape(-1))
            if self.world_size > 1:
                _reduce_scatter_(flat_grad.tensor_split(self.world_size), "sum", self.rank)
            if self.stage == 1:
                g.shard.grad.div_(self.world_size)  # a view of flat_grad[start:end]
            else:
                torch.div(flat_grad[g.start : g.end], self.world_size, out=g.shard.grad)
                del flat_grad
            # Only this rank's shard of the reduced gradient is meaningful now (stage 1's
            # buffer holds partial sums elsewhere): the model's gradients go.
            for p in g.params:
                p.grad = None
        self.optimizer.step()
        for g in self._groups:
            if self.world_size > 1 and g.numel > 0:
                _all_gather_(g.flat.tensor_split(self.world_size), self.rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (``None``, or zeros with ``set_to_none=False``)."""
        for g in self._groups:
            for p in g.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ------------------------------------------------------------------------ torch.optim API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups: the options (``lr``, ...) can be read and changed here;
        ``params`` holds this rank's shard of each group."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The inner optimizer's state: for this rank's shards only."""
        return self.optimizer.state

    @property
    def shards(self) -> list[nn.Parameter]:
        """This rank's shard of each group: flat views of the parameters it updates."""
        return [g.shard for g in self._groups]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this optimizer holds (the model's ``.grad`` are views
        of them during backward): the flat gradient buffers at stage 1, the shards at stage 2."""
        held = [g.grad for g in self._groups if g.grad is not None]
        if self.stage == 2:
            held = [g.shard.grad for g in self._groups]
        return sum(t.nbytes for t in held)

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, group numel) of this rank's shard in each group's flat buffer."""
        return [(g.start, g.end, g.numel) for g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: the inner optimizer's state (its shards)
        and the layout it belongs to. Save one file per rank."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "layout": self._layout(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (saved by the same rank, same world size
        and the same parameters)."""
        if "layout" not in state_dict or "optimizer" not in state_dict:
            raise ValueError(
                "not a ShardedOptimizer checkpoint (expected the keys 'optimizer' and "
                "'layout'): load what ShardedOptimizer.state_dict() returned on this rank"
            )
        saved, mine = state_dict["layout"], self._layout()
        if saved != mine:
            raise ValueError(
                f"this checkpoint belongs to rank {saved['rank']} of {saved['world_size']} "
                f"with groups of {saved['numels']} elements; this is rank {self.rank} of "
                f"{self.world_size} with groups of {mine['numels']}. Load each rank's own file "
                "on the same world size and model (resharding is not supported)"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def _layout(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "stage": self.stage,
            "numels": [g.numel for g in self._groups],
            "shards": [(g.start, g.end) for g in self._groups],
        }

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.end - g.start}/{g.numel}" for g in self._groups)
        return (
            f"ShardedOptimizer(stage={self.stage}, {self.optimizer_cls.__name__}, rank "
            f"{self.rank} of {self.world_size}, shard elements per group: {sizes})"
        )


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """A torch optimizer's ``params`` argument as a list of groups (dicts with "params")."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or of dicts, not a tensor: pass "
            "model.parameters() or [tensor]"
        )
    items = list(params)
    if not items:
        raise ValueError(
            "ShardedOptimizer got an empty parameter list: pass model.parameters() (a "
            "generator can be used only once; did something consume it already?)"
        )
    if all(isinstance(item, dict) for item in items):
        groups = []
        for item in items:
            if "params" not in item:
                raise ValueError("every parameter group needs a 'params' entry")
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append({**item, "params": ps})
    elif any(isinstance(item, dict) for item in items):
        raise TypeError("params mixes tensors and dicts: pass either tensors or parameter groups")
    else:
        groups = [{"params": items}]
    seen: set[int] = set()
    for g in groups:
        for p in g["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"expected parameters (tensors), got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("a parameter appears twice in params; pass each once")
            seen.add(id(p))
            if p.requires_grad and not p.is_leaf:
                raise ValueError("can only optimize leaf tensors (model parameters)")
    return groups


# ------------------------------------------------------------- ZeRO-3 preview: torch's FSDP2
_COLLECTIVES = {  # torch.distributed function -> (what it is, which argument has the full size)
    "all_gather_single": ("all-gather", "output"),
    "all_gather_into_tensor": ("all-gather", "output"),
    "reduce_scatter_single": ("reduce-scatter", "input"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "all_reduce": ("all-reduce", "tensor"),
}


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, int]]]:
    """Log the collectives that Python code calls through ``torch.distributed`` in the block.

    Yields a list that fills with ``("collective", kind, bytes)``, where bytes is the size of the
    whole tensor (the gathered output, the input that is reduce-scattered); code may append its
    own markers. It sees calls made from Python, as FSDP2's are, not those made from C++ (DDP's
    reducer). Chapter 9 uses it to show what FSDP gathers when.
    """
    import torch.distributed as dist

    log: list[tuple[str, str, int]] = []
    originals = {}

    def wrap(name: str, kind: str, arg: str, original):
        position = 0 if arg in ("output", "tensor") else 1

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            t = kwargs.get(arg, args[position] if len(args) > position else None)
            if isinstance(t, torch.Tensor):
                log.append(("collective", kind, t.numel() * t.element_size()))
            return original(*args, **kwargs)

        return recorded

    for name, (kind, arg) in _COLLECTIVES.items():
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, kind, arg, originals[name]))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def fsdp_step_events(
    model: nn.Module,
    layers: list[str],
    inputs: tuple,
    loss_fn: Callable,
    target: torch.Tensor,
    reshard_root: bool = True,
) -> tuple[list[tuple[str, str, int]], int]:
    """Runs on every rank: wrap ``model`` with FSDP2 (``fully_shard`` on each submodule named in
    ``layers``, then on the model, whose group holds the remaining parameters), run one forward
    and backward, and return what happened in order, ``("forward"|"backward", layer, 0)``
    markers between ``("collective", kind, bytes)`` entries, with this rank's number of
    parameter elements after sharding. ``reshard_root``: free the root's gathered parameters
    after forward too (pure ZeRO-3; FSDP's default keeps them for backward)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    with record_collectives() as log, warnings.catch_warnings():
        # FSDP2 warns that a layer returned a view (an in-place op on it would skip its
        # pre-backward hook); nothing here modifies outputs in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")

        def mark_backward(module, args, output, name) -> None:
            # the gradient of the layer's output arrives just before the layer's backward
            output.register_hook(lambda grad: log.append(("backward", name, 0)))

        for name in layers:
            module = modules[name]
            module.register_forward_pre_hook(
                lambda m, args, name=name: log.append(("forward", name, 0))
            )
            module.register_forward_hook(functools.partial(mark_backward, name=name))
            fully_shard(module)
        fully_shard(model, reshard_after_forward=reshard_root)
        local = sum(p.to_local().numel() for p in model.parameters())
        loss_fn(model(*inputs), target).backward()
    return log, local


# ---------------------------------------------------------- side by side (chapter 9, bench)
VARIANTS = ("DDP, unsharded", "ZeroRedundancyOptimizer", "ShardedOptimizer", "ShardedOptimizer s2")


def make_variant(
    name: str, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
) -> tuple[nn.Module, Any, Any]:
    """One way to train ``model`` on every rank of a process group, by ``name``:

    * ``"DDP, unsharded"``: torch's ``DistributedDataParallel`` and an unsharded
      ``optimizer_cls`` (plain data parallelism);
    * ``"ZeroRedundancyOptimizer"``: torch's DDP and ``ZeroRedundancyOptimizer(optimizer_cls)``;
    * ``"ShardedOptimizer"`` / ``"ShardedOptimizer s2"``: :class:`ShardedOptimizer`, stage 1 / 2.

    Returns ``(module to call, optimizer, the optimizer that holds this rank's state)``.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if name == "DDP, unsharded":
        opt = optimizer_cls(model.parameters(), **kwargs)
        return DistributedDataParallel(model), opt, opt
    if name == "ZeroRedundancyOptimizer":
        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_cls, **kwargs)
        return DistributedDataParallel(model), zro, zro.optim
    if name in ("ShardedOptimizer", "ShardedOptimizer s2"):
        stage = 2 if name.endswith("s2") else 1
        opt = ShardedOptimizer(model.parameters(), optimizer_cls, stage=stage, **kwargs)
        return model, opt, opt
    raise ValueError(f"unknown variant {name!r}; the variants are {VARIANTS}")


def train_variants_on_rank(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[int, int], tuple],
    loss_fn: Callable,
    steps: int,
    optimizer_cls: type[torch.optim.Optimizer],
    variants: tuple[str, ...] = VARIANTS,
    return_params: bool = True,
    **optimizer_kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """Runs on every rank: train a fresh ``make_model()`` for ``steps`` steps in each way of
    :func:`make_variant`, on batches ``make_batch(step, rank)`` = ``(inputs..., target)``.

    Returns, per variant: ``losses`` (mean over ranks, per step), ``params`` (the final
    parameters, flattened, on the CPU), ``state_bytes`` (this rank's optimizer state) and
    ``grad_bytes`` (gradient memory this rank holds after the last step: the model's ``.grad``
    tensors plus ShardedOptimizer's own flat gradient buffer or gradient shard). With
    ``return_params=False``, ``params`` is ``None`` (large models travel back faster). Chapter 9.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in variants:
        model = make_model()
        module, opt, holder = make_variant(name, model, optimizer_cls, **optimizer_kwargs)
        losses = []
        for step in range(steps):
            *inputs, target = make_batch(step, rank)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(module(*inputs), target)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        if isinstance(opt, ShardedOptimizer):
            grad_bytes += opt.gradient_bytes()
        out[name] = {
            "losses": losses,
            "params": torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
            if return_params
            else None,
            "state_bytes": optimizer_state_bytes(holder),
            "grad_bytes": grad_bytes,
        }
    return out
