"""Streaming DiLoCo: the model in fragments, synchronised in turn, in the background, in 8 bits.

DiLoCo sends the whole model at the end of every round, and every replica waits for it: the
link idles for H steps, then carries the model while the compute waits. Streaming DiLoCo
(Douillard et al., 2025) changes three things:

* **fragments**: the model is cut into F fragments (groups of layers), and fragment f is
  synchronised every H steps like DiLoCo, but the fragments take turns, one every H/F steps:
  each synchronisation sends 1/F of the model, so the peak bandwidth is F times lower for the
  same bytes per step;
* **overlap**: a fragment's pseudo-gradient is sent ``delay`` inner steps (the paper's tau)
  before the outer step needs it, and the inner steps go on meanwhile; when it arrives, the
  fragment's local weights, which moved during those steps, are mixed with the new global ones,
  ``lerp(global, local, alpha)`` (``alpha=0`` keeps the global weights only);
* **quantisation**: the pseudo-gradients travel in fp8 with a scale per block
  (:mod:`.quantization`), 4 times fewer bytes.

:class:`StreamingDiLoCo` follows the schedule of torchft's ``DiLoCo`` with
``fragment_sync_delay`` and ``fragment_update_alpha``: fragment 0 at step H/F, fragment 1 at
2H/F, and so on. :func:`streaming_reference` is the algorithm in one process, which
``tests/test_communicating_less.py`` checks it against (and, unquantised, against torchft's).

Chapter 12: Streaming DiLoCo, fragments synchronised in turn and overlapped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.communicating_less.diloco import MakeOptimizer
from dpcourse.communicating_less.quantization import quantized_all_reduce, quantized_mean

__all__ = ["Fragment", "StreamingDiLoCo", "streaming_reference"]


class Fragment:
    """A part of the model that is synchronised as one: its parameters, its outer optimizer and
    the weights its round started from; :meth:`send` starts averaging its pseudo-gradient in
    the background, :meth:`receive` waits for it and takes the outer step."""

    def __init__(self, module: nn.Module, outer: torch.optim.Optimizer,
                 group: dist.ProcessGroup | None = None) -> None:
        self.params, self.outer, self.group = list(module.parameters()), outer, group
        self.start = [p.detach().clone() for p in self.params]
        self.flat: torch.Tensor | None = None
        self.wait: Callable[[], object] = lambda: None

    @torch.no_grad()
    def send(self, quantize: bool, background: ThreadPoolExecutor) -> None:
        """Start averaging ``start - params`` over the ranks, as one flat
        tensor; return at once (an asynchronous all-reduce, or the quantised
        one on a thread)."""
        self.flat = torch.cat([(s - p).reshape(-1) for s, p in zip(
            self.start, self.params, strict=True)])
        if quantize:
            self.wait = background.submit(quantized_all_reduce, self.flat,
                                          self.group).result
        else:
            work = dist.all_reduce(self.flat, group=self.group, async_op=True)
            world = dist.get_world_size(self.group)
            self.wait = lambda: (work.wait(), self.flat.div_(world))

    @torch.no_grad()
    def receive(self, alpha: float) -> None:
        """Wait for the average, step the outer optimizer from the round's
        start, keep the result as the next round's start, and mix in the local
        steps taken meanwhile."""
        self.wait()
        local = [p.clone() for p in self.params]
        at = 0
        for p, s in zip(self.params, self.start, strict=True):
            p.copy_(s)
            p.grad = self.flat[at : at + p.numel()].view_as(p)
            at += p.numel()
        self.outer.step()
        self.outer.zero_grad()
        for s, p, mine in zip(self.start, self.params, local, strict=True):
            s.copy_(p)
            p.lerp_(mine, alpha)  # alpha 0: the global weights; 1: local


class StreamingDiLoCo:
    """Streaming DiLoCo on this rank: ``inner`` steps the model every step; ``fragments``
    (modules that cover it, each with its outer optimizer in ``outers``) are synchronised in
    turn, one every ``sync_every / len(fragments)`` steps, each sent ``delay`` steps before its
    outer step. Call :meth:`step` in place of ``inner.step()``; :meth:`close` at the end."""

    def __init__(self, fragments: Sequence[nn.Module], inner: torch.optim.Optimizer,
                 outers: Sequence[torch.optim.Optimizer], sync_every: int, delay: int = 0,
                 alpha: float = 0.0, quantize: bool = False,
                 group: dist.ProcessGroup | None = None) -> None:
        if sync_every < len(fragments) or sync_every % len(fragments):
            raise ValueError(f"sync_every ({sync_every}) must be a multiple of the number of "
                             f"fragments ({len(fragments)}): one fragment syncs at a time")
        if not 0 <= delay < sync_every // len(fragments):
            raise ValueError(f"delay must be from 0 to sync_every / fragments - 1 = "
                             f"{sync_every // len(fragments) - 1}, got {delay}: a fragment must "
                             "arrive before the next one is sent")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha mixes local into global weights, in [0, 1]; got {alpha}")
        self.fragments = [Fragment(m, o, group) for m, o in zip(fragments, outers, strict=True)]
        self.inner, self.delay, self.alpha, self.quantize = inner, delay, alpha, quantize
        self.period = sync_every // len(fragments)
        self.local_step, self.next = 0, 0  # steps since the last sync; whose turn it is
        self.background = ThreadPoolExecutor(max_workers=1)

    def step(self) -> None:
        """One inner step; send the next fragment ``delay`` steps before its
        turn, and take its outer step on its turn."""
        self.inner.step()
        self.local_step += 1
        fragment = self.fragments[self.next]
        if self.local_step == self.period - self.delay:
            fragment.send(self.quantize, self.background)
        if self.local_step == self.period:
            fragment.receive(self.alpha)
            self.next = (self.next + 1) % len(self.fragments)
            self.local_step = 0

    def close(self) -> None:
        self.background.shutdown()


def streaming_reference(model: nn.Module, batches: Sequence[Sequence[Sequence[torch.Tensor]]],
                        loss_fn: Callable, make_inner: MakeOptimizer, make_outer: MakeOptimizer,
                        sync_every: int, fragments: Sequence[Sequence[str]], delay: int = 0,
                        alpha: float = 0.0, quantize: bool = False) -> list[nn.Module]:
    """Streaming DiLoCo in one process: replicas of ``model`` in a list, ``batches[t][w]`` the
    ``(inputs, targets)`` of replica ``w`` at step ``t``, ``fragments`` the parameter names of
    each fragment, an outer optimizer each. Returns the replicas after the last step."""
    theta = copy.deepcopy(model)  # the global weights (every replica's round start)
    named = dict(theta.named_parameters())
    outers = [make_outer([named[n] for n in names]) for names in fragments]
    workers = [copy.deepcopy(model) for _ in batches[0]]
    inners = [make_inner(w.parameters()) for w in workers]
    period, turn, average = sync_every // len(fragments), 0, None
    for t, step_batches in enumerate(batches, start=1):
        for w, opt, (x, y) in zip(workers, inners, step_batches, strict=True):
            opt.zero_grad()
            loss_fn(w(x), y).backward()
            opt.step()
        step_in_period, names = (t - 1) % period + 1, fragments[turn]
        with torch.no_grad():
            if step_in_period == period - delay:  # the pseudo-gradient as sent
                deltas = [torch.cat([(named[n] - dict(w.named_parameters())[n]).reshape(-1)
                                     for n in names]) for w in workers]
                average = quantized_mean(deltas) if quantize else torch.stack(deltas).mean(0)
            if step_in_period == period:
                at = 0
                for n in names:
                    named[n].grad = average[at : at + named[n].numel()].view_as(named[n])
                    at += named[n].numel()
                outers[turn].step()
                outers[turn].zero_grad()
                for w in workers:
                    mine = dict(w.named_parameters())
                    for n in names:
                        mine[n].copy_(torch.lerp(named[n], mine[n], alpha))
                turn = (turn + 1) % len(fragments)
    return workers
