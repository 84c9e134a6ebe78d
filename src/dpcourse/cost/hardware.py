"""The hardware the book quotes: published peak figures of GPUs and of the links between them.

Every figure is a datasheet number with its source; the latencies are assumptions of the right
order (a few microseconds). Chapters 5 to 10 price their collectives and steps with them
(:mod:`dpcourse.cost.costmodel`, :mod:`dpcourse.cost.scaling`); nothing here is measured.

Chapter 5: the hardware figures the book quotes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GPU", "Link", "rate_bits", "H100", "A100", "NVLINK4", "NVLINK3", "IB_NDR", "IB_HDR"]


@dataclass(frozen=True)
class GPU:
    """A GPU's peak dense throughput in FLOP/s for the training precision, and its source."""

    name: str
    peak_flops: float
    source: str


@dataclass(frozen=True)
class Link:
    """A link of latency ``alpha`` (seconds per message) and bandwidth ``beta`` (bytes per
    second, one direction, per GPU), and where the bandwidth figure comes from. The latencies
    are assumptions of the right order (a few microseconds), not datasheet figures."""

    name: str
    alpha: float
    beta: float
    source: str


H100 = GPU(
    "H100 SXM5, bf16 dense",
    989e12,
    "NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)",
)
A100 = GPU(
    "A100 SXM4, bf16 dense",
    312e12,
    "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 dense (624 with sparsity)",
)
NVLINK4 = Link(
    "NVLink 4 (H100, within a node)",
    3e-6,
    450e9,
    "NVIDIA H100 datasheet: NVLink 900 GB/s, i.e. 450 GB/s each way",
)
NVLINK3 = Link(
    "NVLink 3 (A100, within a node)",
    3e-6,
    300e9,
    "NVIDIA A100 datasheet: NVLink 600 GB/s, i.e. 300 GB/s each way",
)
IB_NDR = Link(
    "InfiniBand NDR, one 400 Gb/s NIC per GPU",
    5e-6,
    50e9,
    "NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s = 50 GB/s each way",
)
IB_HDR = Link(
    "InfiniBand HDR, one 200 Gb/s NIC per GPU",
    5e-6,
    25e9,
    "NVIDIA ConnectX-6 / Quantum HDR: 200 Gb/s = 25 GB/s each way",
)


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")


def rate_bits(rate: str, name: str = "a link rate") -> float:
    """A ``tc`` rate such as ``"1gbit"``, ``"400mbit"`` or ``"800kbit"``, in bits per second
    (``name`` is what the error calls the argument)."""
    match = _RATE.match(rate.strip().lower()) if isinstance(rate, str) else None
    bits = float(match[1]) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]] if match else 0.0
    if not bits > 0:
        raise ValueError(
            f"{name} must be a rate above 0 written as tc writes it, a string such as "
            f"'1gbit', '400mbit' or '100kbit'; got {rate!r}"
        )
    return bits
