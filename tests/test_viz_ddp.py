"""The plots of chapter 7 draw what the chapter says they draw, on made-up data."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dpcourse.plots import ddp as viz_ddp  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_overlap_plot_pairs_overlapped_and_sequential_bars_per_cap():
    caps, counts = [0.1, 0.25, 1], [8, 3, 1]
    overlapped, after = [0.080, 0.090, 0.102], [0.106, 0.104, 0.104]
    fig = viz_ddp.plot_overlap(caps, overlapped, after, counts,
                               {"no communication": 0.050}, "slow link",
                               "measured now, 2 CPU cores")
    (ax,) = fig.axes
    first, second = (c for c in ax.containers)  # one bar container per series
    assert [b.get_height() for b in first] == pytest.approx([80, 90, 102])  # in ms
    assert [b.get_height() for b in second] == pytest.approx([106, 104, 104])
    for a, b in zip(first, second, strict=True):  # side by side, overlapped on the left
        assert a.get_x() + a.get_width() == pytest.approx(b.get_x())
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "0.1 MiB\n8 buckets", "0.25 MiB\n3 buckets", "1 MiB\n1 bucket"]
    (line,) = ax.lines
    assert list(line.get_ydata()) == pytest.approx([50, 50])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "no communication", "overlapped (launched during backward)",
        "no overlap (launched after backward)"]
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["80", "90", "102", "106", "104", "104"]
    assert ax.get_title() == "slow link\nmeasured now, 2 CPU cores"


def test_overlap_plot_refuses_series_of_different_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        viz_ddp.plot_overlap([0.1, 1], [0.08], [0.1, 0.1], [8, 1], {}, "m", "t")


def test_overlap_table_lists_every_variant_with_its_cost_over_none():
    medians = {"none": 0.05, "DDP cap 0.1": 0.08, "DDP no overlap cap 0.1": 0.105}
    table = viz_ddp.overlap_table(medians, {"DDP cap 0.1": 0.03, "DDP no overlap cap 0.1": 0.055},
                                  [0.1], [8])
    lines = table.splitlines()
    assert lines[0].split() == ["variant", "buckets", "median", "step", "over", "none"]
    assert lines[2].split() == ["DDP", "cap", "0.1", "8", "80.0", "ms", "30.0", "ms"]
    assert lines[3].split()[-2:] == ["55.0", "ms"]
