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
    (legend,) = fig.legends  # below the axes, where it covers nothing
    assert ax.get_legend() is None
    assert [t.get_text() for t in legend.get_texts()] == [
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


def test_the_bucket_animation_replays_the_reducers_events_frame_by_frame():
    from dpcourse.ddp.timeline import BucketEvent

    events = [BucketEvent("ready", 0, 0, 0.001), BucketEvent("ready", 0, 1, 0.002),
              BucketEvent("launched", 0, -1, 0.0021), BucketEvent("ready", 1, 0, 0.003),
              BucketEvent("launched", 1, -1, 0.0031), BucketEvent("completed", 0, -1, 0.004),
              BucketEvent("completed", 1, -1, 0.005)]
    frames = viz_ddp._bucket_states(events, [[8, 4096], [4096]])
    assert len(frames) == len(events) + 1
    assert frames[0]["state"] == ["filling", "filling"] and not any(frames[0]["ready"][0])
    assert frames[3]["state"] == ["in flight", "filling"] and frames[3]["ready"] == [
        [True, True], [False]]
    assert frames[-1]["state"] == ["averaged", "averaged"]
    assert "bucket 0 is full" in frames[3]["caption"]
    anim = viz_ddp.bucket_animation(events, [[8, 4096], [4096]], "two buckets")
    html = anim.to_jshtml()
    assert html.count("data:image/png;base64") >= len(frames)


def test_bucket_events_records_the_reducers_own_events_on_two_ranks():
    import torch
    import torch.distributed as dist

    from dpcourse.harness.launch import run_ranks

    def on_rank():
        from dpcourse.ddp import ddp, timeline
        from dpcourse.one_device import models

        torch.manual_seed(0)
        model = ddp.DDP(models.MLP(in_features=8, hidden=64, out_features=2), bucket_cap_mb=0.01)
        x = torch.randn(4, 8) * (dist.get_rank() + 1)
        return timeline.bucket_events(model, model(x).square().mean())

    events, slots = run_ranks(on_rank, 2, backend="gloo")[0]
    ready = [(e.bucket, e.slot) for e in events if e.kind == "ready"]
    assert sorted(ready) == [(b, k) for b, s in enumerate(slots) for k in range(len(s))]
    launched = [e.bucket for e in events if e.kind == "launched"]
    assert launched == list(range(len(slots))) and len(slots) > 1
    assert sorted(e.bucket for e in events if e.kind == "completed") == launched
    for b in launched:  # a bucket leaves once its last gradient is in, and completes after
        times = {e.kind: e.seconds for e in events if e.bucket == b and e.kind != "ready"}
        last_in = max(e.seconds for e in events if e.kind == "ready" and e.bucket == b)
        assert last_in <= times["launched"] <= times["completed"]
