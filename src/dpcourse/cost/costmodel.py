"""The alpha-beta cost model of the collectives.

Sending ``n`` bytes between two ranks costs ``alpha + n / beta``: ``alpha`` is the latency of
one message (seconds), ``beta`` the bandwidth (bytes per second). An algorithm is a number of
message rounds and a number of bytes each rank must push through its link, one after the other:

==========  =======================  ===============================
algorithm   latency term             bandwidth term
==========  =======================  ===============================
naive       2(N-1) alpha             2(N-1) n / beta  (all via rank 0)
tree        2 ceil(log2 N) alpha     2 ceil(log2 N) n / beta
ring        2(N-1) alpha             2(N-1)/N n / beta
==========  =======================  ===============================

``"halving-doubling"`` is modelled too, for ``N`` a power of two: recursive halving for the
reduce-scatter and recursive doubling for the all-gather (Rabenseifner's algorithm, Thakur et
al. 2005), ``2 log2(N)`` latencies and the ring's ``2(N-1)/N n / beta``. It is not in
:data:`ALGORITHMS`, the algorithms that the package implements and simulates.

The ring pays the most latency but the least bandwidth, which for large gradients is what
counts: its bandwidth term does not grow with N. :func:`all_reduce_time` is the model (the one
definition of the course: chapter 10's step time calls it too); :func:`fit` finds ``alpha`` and
``beta`` from measured times by least squares, and :func:`fit_link` finds them for one link
from point-to-point messages, to predict every algorithm from the network alone.

Chapter 6: the alpha-beta cost model of the all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ALGORITHMS", "terms", "all_reduce_time", "Fit", "fit", "fit_link"]

ALGORITHMS = ("naive", "tree", "ring")


def terms(algorithm: str, world_size: int) -> tuple[float, float]:
    """(number of latencies, multiple of n/beta) that an all-reduce of ``algorithm`` costs."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {n}")
    if n == 1:
        return 0.0, 0.0
    if algorithm == "naive":
        return 2.0 * (n - 1), 2.0 * (n - 1)
    if algorithm == "tree":
        rounds = math.ceil(math.log2(n))
        return 2.0 * rounds, 2.0 * rounds
    if algorithm == "ring":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if algorithm == "halving-doubling":
        if n & (n - 1):
            raise ValueError(f"halving-doubling is modelled for a world_size that is a power "
                             f"of two, got {n}")
        return 2.0 * math.log2(n), 2.0 * (n - 1) / n
    raise ValueError(f"algorithm must be one of {ALGORITHMS} or 'halving-doubling', "
                     f"got {algorithm!r}")


def all_reduce_time(
    algorithm: str,
    world_size: int,
    nbytes,
    alpha: float,
    beta: float,
    buckets: int = 1,
):
    """Modelled seconds to all-reduce ``nbytes`` (a number or an array) with ``algorithm`` on
    ``world_size`` ranks over links of latency ``alpha`` and bandwidth ``beta``, cut into
    ``buckets`` equal all-reduces one after the other (DDP's buckets, chapter 7): every bucket
    pays the latency term, the bytes are paid once. For the ring:
    ``buckets * 2(N-1) alpha + 2(N-1)/N * nbytes / beta``."""
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    latencies, volume = terms(algorithm, int(world_size))
    seconds = buckets * latencies * alpha + volume * np.asarray(nbytes, dtype=float) / beta
    return float(seconds) if seconds.ndim == 0 else seconds


@dataclass(frozen=True)
class Fit:
    algorithm: str
    world_size: int
    alpha: float  # seconds per message
    beta: float  # bytes per second

    def predict(self, size_bytes):
        """Modelled seconds of an all-reduce of ``size_bytes`` with the fitted alpha and beta."""
        return all_reduce_time(self.algorithm, self.world_size, size_bytes, self.alpha, self.beta)


def fit(
    algorithm: str, world_size: int, sizes_bytes: Sequence[float], seconds: Sequence[float]
) -> Fit:
    """Least-squares ``alpha`` and ``beta`` from measured times, weighting every point by
    1/time so that small messages (latency) count as much as large ones (bandwidth)."""
    a, b = terms(algorithm, world_size)
    sizes = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if sizes.shape != t.shape or sizes.size < 2:
        raise ValueError("need at least two (size, time) measurements of the same length")
    design = np.stack([np.full_like(sizes, a), b * sizes], axis=1) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = max(float(inv_beta), 1e-15)
    return Fit(algorithm, world_size, alpha, 1.0 / inv_beta)


def fit_link(
    sizes_bytes: Sequence[float], seconds: Sequence[float], large: float = 2**20
) -> tuple[float, float]:
    """``(alpha, beta)`` of one link from one-way message times (``alpha + n / beta``).

    ``beta`` is the slope of the times of the messages of at least ``large`` bytes (least
    squares), where the latency is lost in the noise; ``alpha`` is what the smallest message
    took beyond its bytes, which is nearly all latency. (Fitting both to every point at once
    would let the small messages, which a token-bucket link lets through at once, bend the
    slope.) Chapter 6 fits them on the emulated cluster's links and predicts each all-reduce
    from them."""
    sizes = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    big = sizes >= large
    if sizes.shape != t.shape or big.sum() < 2 or sizes.min() >= large:
        raise ValueError(
            f"need one message under {large:g} bytes and two or more of at least that, with "
            "a time for each"
        )
    slope = np.polyfit(sizes[big], t[big], 1)[0]
    beta = 1.0 / max(float(slope), 1e-15)
    smallest = int(np.argmin(sizes))
    return max(float(t[smallest] - sizes[smallest] / beta), 0.0), beta
