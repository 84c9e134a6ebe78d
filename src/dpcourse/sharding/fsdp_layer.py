"""One fully sharded layer: its parameters cut into rows, gathered for use, freed after (chapter 9).

:class:`ShardedLayer` is what torch's FSDP2 calls a parameter group: the parameters of one layer
(a submodule), sharded together and gathered together in one collective.

* **Shard.** Each parameter is cut along dim 0 into N pieces, as
  :func:`~dpcourse.collectives.ops.chunk_bounds` cuts its rows (the first ``rows % N`` ranks get
  one row more; a rank can get none). Rank r keeps its rows as an fp32 ``nn.Parameter``, the
  shard, which the layer's module holds between uses.
* **Gather.** The layer's gather buffer is laid out rank by rank: rank r's chunk is its shards
  of every parameter, end to end. Each rank copies its shards into its chunk (cast to the
  compute dtype first, so the traffic is in that dtype) and the ring all-gather of chapter 6
  fills the other chunks (:meth:`ShardedLayer.all_gather`, on the communication thread). The
  rows are then copied out into the full parameters, where the layer computes
  (:meth:`ShardedLayer.copy_out`), and the buffer is let go.
* **Free.** A full parameter keeps its tensor object for autograd (the layer's backward saved
  it) and loses its memory: ``untyped_storage().resize_(0)``. Gathering again before backward
  gives it memory back and copies the rows into it, without autograd noticing (``.data``).
* **Reduce-scatter.** The layer's gradients, in the reduce dtype (fp32 by default), are laid out
  rank by rank as the gather buffer is (trainable parameters only); after the ring
  reduce-scatter rank r's chunk is the sum of its rows' gradients, which it divides by N
  (:func:`divide_factors`: in fp16, partly before the sum) and adds to its shards' ``.grad``.

Chapter 11 adds three things. The gradients can be reduced in another dtype than fp32
(``reduce_dtype``, as FSDP2's ``MixedPrecisionPolicy`` does). Between micro-batches whose
gradients are not synchronised, :meth:`ShardedLayer.accumulate` keeps the full gradients, in
the reduce dtype, for the next reduce-scatter. And a layer can be sharded over a sub-group of the
ranks (``group``: the ranks of one node) and replicated across such groups
(``replicate_group``: the ranks, one per node, that hold the same rows): that is hybrid sharding
(HSDP), whose reduce-scatter inside the node is followed by an all-reduce of this rank's chunk
across the nodes (:meth:`ShardedLayer.reduce_across_replicas`).

The collectives run on FSDP's communication thread (:mod:`dpcourse.sharding.fsdp_comm`):
:meth:`ShardedLayer.all_gather` and :meth:`ShardedLayer.reduce_scatter` are what it runs.

Chapter 9: fully sharded data parallelism, one layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.collectives.ops import chunk_bounds
from dpcourse.collectives.ring import ring_all_gather_, ring_reduce_scatter_
from dpcourse.sharding.flat_shards import all_finite

__all__ = ["ShardedLayer", "shard_rows", "gather_chunk_numels", "divide_factors"]


def shard_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(first row, end row) of each rank's shard of a parameter with ``rows`` rows (dim 0)."""
    return chunk_bounds(rows, world_size)


def gather_chunk_numels(shapes: list[tuple[int, ...]], world_size: int) -> list[int]:
    """Elements of each rank's chunk of a layer's gather buffer, for parameters of ``shapes``:
    rank r's chunk holds its rows of every parameter, a row of a ``(rows, *rest)`` parameter
    being ``prod(rest)`` elements (a 0-dimensional parameter counts as one row of one).
    Chapter 9's exercise ex-9-fsdp-chunks asks for it."""
    sizes = [0] * world_size
    for shape in shapes:
        rows = shape[0] if len(shape) else 1
        row = 1
        for d in shape[1:]:
            row *= d
        for k, (r0, r1) in enumerate(shard_rows(rows, world_size)):
            sizes[k] += row * (r1 - r0)
    return sizes


def divide_factors(ranks: int, reduce_dtype: torch.dtype) -> tuple[int, float]:
    """(pre, post): the gradients of ``ranks`` ranks are averaged by dividing each by ``pre``
    before they are summed and the sum by ``post`` after (``pre * post == ranks``), as
    ``fully_shard`` does (torch's ``_get_gradient_divide_factors``). In fp32 and bf16, whose
    range is fp32's, all of it after (pre 1). In fp16, whose largest number is 65504, about the
    square root of ``ranks`` before: pre doubles while it divides ``ranks`` and is below
    ``ranks / pre`` (2 for 2, 3 or 4 ranks, 8 for 64). Summed first, each rank's 40000 makes
    80000 on 2 ranks, no fp16 number; 20000 + 20000 is one. Divided by all of ``ranks`` first,
    small gradients would sink below fp16's smallest normal number (6.1e-5) and lose digits.
    Chapter 11."""
    if reduce_dtype in (torch.float32, torch.bfloat16, torch.float64):
        return 1, float(ranks)
    pre = 1
    while ranks % pre == 0 and ranks / pre > pre:
        pre *= 2
    return pre, ranks / pre


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return module.get_submodule(path), attr


@dataclass(eq=False)
class ShardedLayer:
    """The parameters of ``module`` (named ``name`` in the wrapped model), sharded over
    ``world_size`` ranks; this rank is ``rank``. Built by :class:`dpcourse.sharding.fsdp.FSDP`.

    ``group``: the process group of those ranks, in which ``rank`` is this rank's (None: every
    rank). ``replicate_group``: the ranks that hold the same rows as this one, one per shard
    group (None: there is one shard group); ``replicas`` is its size. ``reduce_dtype``: the
    dtype the gradients are reduced in."""

    name: str
    module: nn.Module
    rank: int
    world_size: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype = torch.float32
    group: Any = None  # a torch.distributed ProcessGroup, or None: every rank
    replicate_group: Any = None
    replicas: int = 1
    param_names: list[str] = field(default_factory=list)
    shards: list[nn.Parameter] = field(default_factory=list)
    full: list[nn.Parameter] = field(default_factory=list)
    bounds: list[list[tuple[int, int]]] = field(default_factory=list)  # per param, per rank
    gather: Any = None  # an all-gather in flight (a CommWork), or arrived and not copied out
    arrived: int = 0  # gradients of trainable parameters arrived in this backward
    reduced: bool = False  # this backward's reduce-scatter was submitted
    # full gradients of earlier micro-batches not yet reduced (per parameter, reduce dtype)
    accumulated: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def shard(cls, name: str, module: nn.Module, rank: int, world_size: int,
              compute_dtype: torch.dtype | None, *, reduce_dtype: torch.dtype = torch.float32,
              group: Any = None, replicate_group: Any = None, replicas: int = 1
              ) -> ShardedLayer:
        """Replace every parameter of ``module`` by this rank's rows of it (fp32 masters). On
        the ``meta`` device the shards and full parameters are made on ``meta`` too, with no
        memory (chapter 11 then materialises the shards)."""
        layer = cls(name, module, rank, world_size, compute_dtype or torch.float32,
                    reduce_dtype, group, replicate_group, replicas)
        for pname, p in list(module.named_parameters()):
            rows = p.shape[0] if p.dim() > 0 else 1
            full_shape = p.shape if p.dim() > 0 else torch.Size([1])
            bounds = shard_rows(rows, world_size)
            r0, r1 = bounds[rank]
            data = p.detach().reshape(full_shape)[r0:r1].to(torch.float32).clone()
            shard = nn.Parameter(data, requires_grad=p.requires_grad)
            full = nn.Parameter(torch.empty(p.shape, dtype=layer.compute_dtype, device=p.device),
                                requires_grad=p.requires_grad)
            if not full.is_meta:
                full.untyped_storage().resize_(0)  # no memory until gathered
            owner, attr = _owner(module, pname)
            owner._parameters[attr] = shard
            layer.param_names.append(pname)
            layer.shards.append(shard)
            layer.full.append(full)
            layer.bounds.append(bounds)
            layer.accumulated.append(None)
        return layer

    # -------------------------------------------------------------------------- layout
    def _row_numel(self, i: int) -> int:
        shape = self.full[i].shape
        return max(1, self.full[i].numel() // shape[0]) if len(shape) > 0 else 1

    def chunk_numels(self, trainable_only: bool = False) -> list[int]:
        """Elements of each rank's chunk of the gather (or reduce-scatter) buffer."""
        idx = self.trainable() if trainable_only else range(len(self.full))
        return gather_chunk_numels([tuple(self.full[i].shape) for i in idx], self.world_size)

    def trainable(self) -> list[int]:
        return [i for i, s in enumerate(self.shards) if s.requires_grad]

    def full_bytes(self) -> int:
        """Bytes of the full parameters that hold memory now."""
        return sum(f.untyped_storage().nbytes() for f in self.full)

    def unsharded_bytes(self) -> int:
        """Bytes this layer holds unsharded now: its full parameters, and the buffer of an
        all-gather in flight (or arrived and not yet copied out)."""
        in_flight = sum(self.chunk_numels()) * self.full[0].element_size() if self.gather else 0
        return self.full_bytes() + in_flight

    def gather_buffer(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An empty buffer for :meth:`all_gather`, in the compute dtype (or ``dtype``), made on
        the caller's stream: every rank's chunk, rank after rank."""
        return torch.empty(sum(self.chunk_numels()), dtype=dtype or self.compute_dtype,
                           device=self.full[0].device)

    # ------------------------------------------------------------ on the communication thread
    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Fill ``flat`` (from :meth:`gather_buffer`) with every rank's chunk,
        this rank's cast to its dtype (so the traffic is in the compute dtype),
        and return it. Runs on the communication thread; :meth:`copy_out` then
        makes the full parameters of it."""
        chunks = list(flat.split(self.chunk_numels()))
        mine = [s.detach().reshape(-1) for s in self.shards]
        chunks[self.rank].copy_(torch.cat(mine))  # cast to the compute dtype
        if self.world_size > 1:
            ring_all_gather_(chunks, self.rank, self.group)
        return flat

    def reduce_scatter(self, flat_grad: torch.Tensor,
                       nonfinite: torch.Tensor) -> None:
        """Reduce-scatter the layer's gradients (laid out by :meth:`pack_grads`,
        in the reduce dtype), sum this rank's chunk over the replicas (HSDP),
        average and add this rank's rows to the shards' ``.grad``, in fp32
        (communication thread). The average is divided before and after the
        sum (:func:`divide_factors`), and ``nonfinite`` (a 0-dim bool tensor)
        is set if the rows this rank received are not all finite: an fp16 sum
        can overflow where no rank's gradient did, so the flag is taken after
        the sum, not before."""
        ranks = self.world_size * self.replicas
        pre, post = divide_factors(ranks, flat_grad.dtype)
        if pre != 1:
            flat_grad.div_(pre)
        chunks = list(flat_grad.split(self.chunk_numels(trainable_only=True)))
        if self.world_size > 1:
            ring_reduce_scatter_(chunks, "sum", self.rank, self.group)
        mine = self.reduce_across_replicas(chunks[self.rank])
        mine.div_(post)  # every rank's gradient counts once
        nonfinite |= ~all_finite(mine)
        offset = 0
        for i in self.trainable():
            shard = self.shards[i]
            piece = mine[offset : offset + shard.numel()].view_as(shard)
            piece = piece.to(shard.device, shard.dtype)  # offloaded: host
            offset += shard.numel()
            if shard.grad is None:
                shard.grad = piece.clone()
            else:
                shard.grad.add_(piece)

    def reduce_across_replicas(self, chunk: torch.Tensor) -> torch.Tensor:
        """HSDP's second step: ``chunk``, this rank's rows summed over its shard
        group, summed in place over the replicate group too (a ring all-reduce
        among the ranks that hold the same rows, one per node), so that it is
        the sum over every rank. Without a replicate group: ``chunk``."""
        if self.replicate_group is None or self.replicas == 1:
            return chunk
        me = dist.get_rank(self.replicate_group)
        pieces = chunk.tensor_split(self.replicas)  # views: in place
        ring_reduce_scatter_(pieces, "sum", me, self.replicate_group)
        ring_all_gather_(pieces, me, self.replicate_group)
        return chunk

    # ----------------------------------------------------------------------- main thread
    def copy_out(self, flat: torch.Tensor,
                 into: list[torch.Tensor] | None = None) -> None:
        """Copy the rows of a gathered buffer into the full parameters (given
        memory again: the same tensors autograd saved), or into the tensors
        ``into`` (a full state dict gathers the fp32 masters so). On the compute
        stream, where the layer uses them."""
        if into is None:
            for full in self.full:
                if full.untyped_storage().nbytes() == 0:  # freed: memory again
                    nbytes = full.numel() * full.element_size()
                    full.untyped_storage().resize_(nbytes)  # the same tensor
            into = [full.data for full in self.full]
        for k, chunk in enumerate(flat.split(self.chunk_numels())):
            offset = 0
            for i, target in enumerate(into):
                r0, r1 = self.bounds[i][k]
                n = self._row_numel(i) * (r1 - r0)
                if n:
                    rows = target.view(-1, self._row_numel(i))[r0:r1]
                    rows.copy_(chunk[offset : offset + n].view_as(rows))
                offset += n

    def has_grad(self, i: int) -> bool:
        """Whether parameter ``i`` got a gradient since the last reduce-scatter (in this
        backward or in a micro-batch accumulated before it)."""
        return self.full[i].grad is not None or self.accumulated[i] is not None

    def accumulate(self) -> None:
        """Gradient accumulation without synchronisation: add the full
        gradients of this backward to those kept from earlier micro-batches, in
        the reduce dtype, and free them (the full gradients stay on this rank,
        whole, until a backward that synchronises)."""
        for i in self.trainable():
            grad = self.full[i].grad
            if grad is None:
                continue
            if self.accumulated[i] is None:
                self.accumulated[i] = grad.detach().to(self.reduce_dtype, copy=True)
            else:
                self.accumulated[i].add_(grad.detach().to(self.reduce_dtype))
            self.full[i].grad = None

    def accumulated_bytes(self) -> int:
        """Bytes of full gradients kept between micro-batches that were not synchronised."""
        return sum(a.numel() * a.element_size() for a in self.accumulated if a is not None)

    def pack_grads(self) -> torch.Tensor:
        """The full gradients in the reduce dtype, rank by rank (zeros where a parameter got
        none), the accumulated ones of earlier micro-batches added; the full gradients freed."""
        pieces = []
        grads = {}
        for i in self.trainable():
            grad, kept = self.full[i].grad, self.accumulated[i]
            if grad is not None:
                grad = grad.detach().to(self.reduce_dtype)
            grads[i] = grad if kept is None else (kept if grad is None else kept.add_(grad))
        for k in range(self.world_size):
            for i in self.trainable():
                full, (r0, r1) = self.full[i], self.bounds[i][k]
                rows = r1 - r0
                if grads[i] is None:
                    pieces.append(torch.zeros(rows * self._row_numel(i), device=full.device,
                                              dtype=self.reduce_dtype))
                else:
                    pieces.append(grads[i].reshape(-1, self._row_numel(i))[r0:r1].reshape(-1))
        for i, full in enumerate(self.full):
            full.grad = None
            self.accumulated[i] = None
        if not pieces:
            return torch.zeros(0, device=self.full[0].device, dtype=self.reduce_dtype)
        return torch.cat(pieces)

    def use_full(self, on: bool) -> None:
        """Put the full parameters (``on``) or the shards back in the module."""
        for name, shard, full in zip(self.param_names, self.shards, self.full, strict=True):
            owner, attr = _owner(self.module, name)
            owner._parameters[attr] = full if on else shard

    def free(self) -> None:
        """Give the full parameters' memory back (their tensor objects stay for autograd), and
        an all-gather's buffer once it has arrived. They were made on the compute stream, so
        their memory is reused only by work queued there after what used them: no
        ``record_stream`` (:mod:`dpcourse.sharding.fsdp_comm`)."""
        if self.gather is not None:  # a prefetch nobody used: its buffer goes once it is in
            self.gather.wait()
            self.gather = None
        for full in self.full:
            full.untyped_storage().resize_(0)
