"""The ring animation follows the real ring's schedule and ends where the ring does."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dpcourse import collectives, runtime
from dpcourse.harness.launch import run_ranks  # noqa: E402
from dpcourse.plots import algorithm_colour  # noqa: E402
from dpcourse.plots import ring as viz_ring  # noqa: E402


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
    x = torch.full((world,), 10.0**rank, dtype=torch.float64, device=runtime.device())
    return collectives.ring_all_reduce(x).tolist()  # sums of powers of ten: exact anywhere


def test_last_frame_equals_the_real_ring():
    frames = viz_ring.ring_frames(3)
    want = [[float(sum(10**r for r in c)) for c in row] for row in frames[-1].holdings]
    assert run_ranks(powers_of_ten, 3) == want


def test_animation_renders_to_javascript():
    html = viz_ring.ring_animation(world=3, interval_ms=100).to_jshtml()
    assert "<script" in html and html.count("data:image/png;base64") == 2 * 2 + 3


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_frames_caption_fits_inside_the_animation(world):
    """Issue 34: the 4-rank animation's longest captions ran past both edges of its frames."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=viz_ring.ring_figsize(world))
    ax = fig.add_subplot()
    renderer = FigureCanvasAgg(fig).get_renderer()
    for frame in viz_ring.ring_frames(world):
        viz_ring.draw_ring_frame(frame, ax)
        box = ax.title.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (frame.caption, box.x0, box.x1)


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


# Section 6.7: the all-reduces over emulated links, on made-up runs as measure_on_cluster returns
def made_up_cluster_runs(slower: float = 1.1) -> dict:
    from dpcourse.cost import costmodel

    sizes, alpha, beta = [2**16, 2**20, 2**22], 2e-4, 1.2e8
    runs = {}
    for n in (2, 4, 8):
        model = {name: [costmodel.all_reduce_time(name, n, s, alpha, beta) for s in sizes]
                 for name in ("naive", "tree", "ring")}
        runs[n] = {"nodes": n, "link": "1gbit", "alpha": alpha, "beta": beta, "sizes": sizes,
                   "model": model,
                   "measured": {name: [t * slower for t in ts] for name, ts in model.items()}}
    return runs


def test_cluster_plot_shows_time_and_bus_bandwidth_against_n_measured_and_modelled():
    import matplotlib.pyplot as plt

    from dpcourse.plots import cluster as viz_cluster

    runs = made_up_cluster_runs()
    fig = viz_cluster.plot_cluster_runs(runs, "made up")
    ax1, ax2 = fig.axes
    assert "emulated 1 Gbit/s links" in fig._suptitle.get_text()
    assert "made up" in fig._suptitle.get_text()
    assert ax1.get_yscale() == "log" and "4 MiB" in ax1.get_title()
    for ax in (ax1, ax2):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8"]
        assert len([line for line in ax.lines if line.get_marker() == "o"]) == 3  # measured
    (below,) = fig.legends  # under both panels, off their lines
    labels = [t.get_text() for t in below.get_texts()]
    assert labels[:3] == ["naive", "tree", "ring"]  # the title says which are measured, which model
    assert labels[3].startswith("link rate")
    assert "measured (dots) against the alpha-beta model" in fig._suptitle.get_text()
    # the ring's modelled bus bandwidth stays near the link, the naive one's falls as beta / N
    ring, naive = algorithm_colour("ring"), algorithm_colour("naive")  # one colour each, bookwide
    ring_model = [line for line in ax2.lines if line.get_color() == ring and
                  line.get_linestyle() == "-"][0]
    busbw = ring_model.get_ydata()
    assert all(0.8 < b < 0.97 for b in busbw)  # Gbit/s: 0.96 less the latencies
    naive_dots = [line for line in ax2.lines if line.get_color() == naive and
                  line.get_marker() == "o"][0].get_ydata()
    assert naive_dots[0] / naive_dots[-1] > 3
    plt.close(fig)
    assert not plt.get_fignums()


def test_model_errors_and_the_table_flag_what_is_off():
    from dpcourse.plots import cluster as viz_cluster

    runs = made_up_cluster_runs(slower=1.1)
    runs[8]["measured"]["tree"][-1] *= 1.2  # 32 % over the model at 4 MiB on 8 nodes
    errors = viz_cluster.model_errors(runs, smallest=2**20)
    assert len(errors) == 3 * 3 * 2
    assert {(n, name, size) for n, name, size, _ in errors} == {
        (n, name, size) for n in (2, 4, 8) for name in ("naive", "tree", "ring")
        for size in (2**20, 2**22)}
    off = [(n, name, size) for n, name, size, e in errors if abs(e) > 0.2]
    assert off == [(8, "tree", 2**22)]
    assert all(abs(e - 0.1) < 1e-9 for n, name, size, e in errors if (n, name, size) not in off)
    table = viz_cluster.cluster_table(runs)
    assert table.count("*") == 1 + 1  # the one case, and the footnote
    assert "64 KiB" in table and " +32%*" in table and "8 nodes: alpha 200 us" in table


def test_recorded_runs_are_read_with_where_and_when_they_were_recorded(tmp_path, monkeypatch):
    import json

    from dpcourse.harness import bench
    from dpcourse.harness.bench import cluster as bench_cluster

    recorded = tmp_path / "benchmarks" / "cpu-2core"
    recorded.mkdir(parents=True)
    machine = {"cpus": 2, "gpus": [], "torch_version": "2.0"}
    for n, run in made_up_cluster_runs().items():
        (recorded / f"ch6-cluster-{n}.json").write_text(json.dumps(
            {**run, "machine": machine, "date": "2026-01-02T03:04:05+00:00"}))
    monkeypatch.setattr(bench, "RECORDED", tmp_path / "benchmarks")
    runs, source = bench_cluster.recorded_runs((2, 4, 8))
    assert sorted(runs) == [2, 4, 8] and runs[8]["nodes"] == 8
    assert source == ("recorded on 2 CPU cores, no GPU, torch 2.0, 2026-01-02 "
                      "(not measured in this build)")
    runs, source = bench_cluster.recorded_runs((2, 3))  # no ch6-cluster-3.json
    assert runs == {} and "for N in [3] is not next to" in source


def test_the_explorer_carries_every_frame_and_draws_without_a_kernel():
    """ring_explorer is HTML and JavaScript with every frame in it (issue 34: its ipywidgets
    sliders moved nothing on the static website); its data are ring_frames' frames."""
    import json
    import re

    frames = viz_ring.explorer_frames(5)
    assert sorted(frames) == [2, 3, 4, 5]
    for world, drawn in frames.items():
        real = viz_ring.ring_frames(world)
        assert [f["caption"] for f in drawn] == [f.caption for f in real]
        assert [f["arrows"] for f in drawn] == [[list(a) for a in f.arrows] for f in real]
        last = drawn[-1]["cells"]
        assert all(cell[3] for row in last for cell in row)  # every chunk holds the whole sum
        assert drawn[0]["cells"][1][0][0] == "b" and drawn[0]["cells"][0][0][3] is False
    html = viz_ring.ring_explorer(max_world=5).data
    assert 'name="ranks" min="2" max="5" value="4"' in html and 'name="frame"' in html
    assert "ipywidgets" not in html and "<script>" in html
    data = json.loads(re.search(r"var data = (\{.*?\});", html).group(1))
    assert data == json.loads(json.dumps(frames))  # the page has them all, keyed by N
    with pytest.raises(ValueError, match="max_world"):
        viz_ring.explorer_frames(1)
    with pytest.raises(ValueError, match="world must be from 2"):
        viz_ring.ring_explorer(max_world=3, world=4)


def test_each_algorithm_has_one_colour_across_the_book():
    assert algorithm_colour("ring") == algorithm_colour("ring_all_reduce") == algorithm_colour(
        "flat ring") == algorithm_colour("ring posted ahead")
    assert algorithm_colour("naive_all_reduce") == algorithm_colour("line: N - 1")
    assert algorithm_colour("two-level") != algorithm_colour("ring")
    names = ("ring", "tree", "naive", "library", "halving-doubling")
    colours = {algorithm_colour(n) for n in names}
    assert len(colours) == 5
    with pytest.raises(KeyError, match="add it"):
        algorithm_colour("butterfly")
