"""Pseudo-gradients sent in 8 bits: fp8 (e4m3) with one fp32 scale per block of values.

Streaming DiLoCo quantises what it all-reduces. Here each block of :data:`BLOCK` values is
scaled so that its largest magnitude is fp8 e4m3's largest, 448, then rounded to e4m3 (4
exponent bits, 3 mantissa bits, no infinities): 1 byte a value plus 4 bytes a block, about 3.9
times fewer bytes than fp32. e4m3's three mantissa bits round each value to within 2^-4 of
itself (6 %); values under 2^-6 / 448 of their block's largest lose bits, and under
2^-10 / 448 (2e-6) they flush to zero. The pseudo-gradient, an average of N replicas' noisy
moves, differs from replica to replica by far more than that (chapter 12 measures both, and
the loss with it).

Why blocks: a fragment is sent as one flat tensor that joins layers of different scales (a bias
and a weight matrix), and one scale for all of it would round a small layer's values coarsely or
flush them to zero; a scale per block of 256 keeps each layer's own, at 4 bytes in 260. torchft
0.2.0 sends the same values (e4m3 with fp32 scales, on GPUs with fp8, compute capability 9.0 and
up; int8 with a largest value of 127 on older ones, in Triton kernels, so not on a CPU) with one
scale per row of each tensor instead of per block. The Streaming DiLoCo paper goes further, to 4
bits (e3m0), at no loss in its runs.

:func:`quantized_all_reduce` averages a tensor over the ranks as torchft's does: every rank
quantises its tensor, sends chunk r to rank r (an all-to-all), rank r dequantises the N chunks
it received and sums them in fp32, quantises its sum and sends it to all (an all-gather): two
roundings, 2(N-1)/N of the quantised bytes per rank, as a ring all-reduce sends of fp32.
:func:`quantized_mean` is the same arithmetic in one process, on a list of tensors.

Chapter 12: quantised pseudo-gradients for Streaming DiLoCo.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["BLOCK", "FP8_MAX", "quantize", "dequantize", "quantized_bytes",
           "quantized_all_reduce", "quantized_mean"]

BLOCK = 256  # values per scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3fn value


def quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` (..., BLOCK), float: (the e4m3 codes as uint8, the same
    shape; the fp32 scale of each block, shape ``blocks.shape[:-1]``)."""
    largest = blocks.abs().amax(dim=-1).float()
    scale = torch.where(largest > 0, FP8_MAX / largest,
                        torch.ones_like(largest))
    codes = (blocks.float() * scale.unsqueeze(-1)).to(FP8).view(torch.uint8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values of :func:`quantize`'s ``(codes, scale)``."""
    return codes.view(FP8).float() / scale.unsqueeze(-1)


def _padded_blocks(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, an equal number per rank: (world, blocks, BLOCK)."""
    per_rank = -(-flat.numel() // (world * BLOCK))
    padded = flat.new_zeros(world * per_rank * BLOCK)
    padded[: flat.numel()] = flat
    return padded.view(world, per_rank, BLOCK)


def quantized_bytes(numel: int, world_size: int) -> int:
    """Bytes a rank sends in :func:`quantized_all_reduce` of ``numel`` values (with the
    padding to whole blocks): the all-to-all and the all-gather, each (N-1)/N of the codes and
    the scales."""
    blocks = world_size * -(-numel // (world_size * BLOCK))
    return 2 * (world_size - 1) * blocks * (BLOCK + 4) // world_size


@torch.no_grad()
def quantized_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Replace ``tensor`` by its mean over the ranks, sent in fp8 with a scale per block (see
    the module): all-to-all of the quantised chunks, an fp32 sum of this rank's chunk,
    all-gather of the quantised sums."""
    world = dist.get_world_size(group)
    codes, scale = quantize(_padded_blocks(tensor.reshape(-1), world))
    got_codes, got_scale = torch.empty_like(codes), torch.empty_like(scale)
    dist.all_to_all_single(got_codes, codes, group=group)  # chunk r of every rank to rank r
    dist.all_to_all_single(got_scale, scale, group=group)
    mine = dequantize(got_codes, got_scale).sum(0) / world  # (blocks, BLOCK): this rank's chunk
    my_codes, my_scale = quantize(mine)
    all_codes, all_scale = torch.empty_like(codes), torch.empty_like(scale)
    dist.all_gather(list(all_codes.unbind(0)), my_codes, group=group)
    dist.all_gather(list(all_scale.unbind(0)), my_scale, group=group)
    mean = dequantize(all_codes, all_scale).reshape(-1)[: tensor.numel()]
    tensor.copy_(mean.view_as(tensor))


def quantized_mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """What :func:`quantized_all_reduce` gives on every rank, ``tensors[r]`` being rank r's, in
    one process: the same blocks, the same two roundings."""
    world = len(tensors)
    blocks = torch.stack([dequantize(*quantize(_padded_blocks(t.reshape(-1), world)))
                          for t in tensors])  # (ranks, world chunks, blocks, BLOCK)
    chunk_sums = blocks.sum(0) / world
    mean = dequantize(*quantize(chunk_sums)).reshape(-1)[: tensors[0].numel()]
    return mean.view_as(tensors[0])
