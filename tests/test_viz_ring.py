"""The ring animation follows the real ring's schedule and ends where the ring does."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dpcourse import collectives, viz_ring  # noqa: E402
from dpcourse.launch import run_ranks  # noqa: E402


@pytest.mark.parametrize("world", [2, 3, 4, 7])
def test_frames_cover_both_phases_and_end_with_every_sum_everywhere(world):
    frames = viz_ring.ring_frames(world)
    assert len(frames) == 2 * (world - 1) + 3
    assert frames[0].holdings == tuple(tuple(frozenset({r}) for _ in range(world))
                                       for r in range(world))
    everyone = frozenset(range(world))
    middle = [f for f in frames if f.phase == "reduce-scatter" and f.step == 0][0]
    for r in range(world):  # after the reduce-scatter rank r owns the sum of chunk r
        assert middle.holdings[r][r] == everyone
    assert all(c == everyone for row in frames[-1].holdings for c in row)
    for f in frames:
        assert len(f.arrows) in (0, world)
        assert all(dst == (src + 1) % world for src, dst, _ in f.arrows)


def powers_of_ten():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((world,), 10.0**rank, dtype=torch.float64)
    return collectives.ring_all_reduce(x).tolist()


def test_last_frame_equals_the_real_ring():
    frames = viz_ring.ring_frames(3)
    want = [[float(sum(10**r for r in c)) for c in row] for row in frames[-1].holdings]
    assert run_ranks(powers_of_ten, 3) == want


def test_animation_renders_to_javascript():
    html = viz_ring.ring_animation(world=3, interval_ms=100).to_jshtml()
    assert "<script" in html and html.count("data:image/png;base64") == 2 * 2 + 3


def test_a_ring_needs_two_ranks():
    with pytest.raises(ValueError, match="at least 2"):
        viz_ring.ring_frames(1)


def test_bytes_per_rank_plot_has_a_dot_series_and_a_line_per_algorithm():
    import matplotlib.pyplot as plt

    busiest = {"ring": [1.0, 1.5], "naive": [1.0, 3.0]}
    formulas = {"ring": lambda n: 2 * (n - 1) / n, "naive": lambda n: n - 1}
    fig = viz_ring.plot_bytes_per_rank([2, 4], busiest, formulas)
    (ax,) = fig.axes
    assert len(ax.lines) == 2 * len(busiest)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["ring (counted)", "naive (counted)"]
    plt.close(fig)
    assert not plt.get_fignums()
