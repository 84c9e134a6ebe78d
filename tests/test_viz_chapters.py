"""The plots of chapters 8 to 10 draw what the chapters say they draw, on made-up data."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dpcourse.plots import practice as viz_practice  # noqa: E402
from dpcourse.plots import scaling as viz_scaling
from dpcourse.plots import sharding as viz_zero
from dpcourse.practice.lr_schedule import LargeBatchRun  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def legend(ax) -> list[str]:
    """The axes' legend's entries, or the figure's where the legend sits under the panels."""
    shown = ax.get_legend() or ax.figure.legends[0]
    return [t.get_text() for t in shown.get_texts()]


def made_up_run(world_size: int, rule: str, warmup: int = 0, steps: int = 20) -> LargeBatchRun:
    batch = 8 * world_size
    lr = 0.02 * {"none": 1, "linear": world_size, "sqrt": world_size**0.5}[rule]
    return LargeBatchRun(
        world_size, rule, warmup, lrs=[lr] * steps,
        losses=[1.0 / (1 + s) for s in range(steps)],
        samples=[(s + 1) * batch for s in range(steps)], final_loss=0.1,
    )


# chapter 8


def test_moving_average_is_the_mean_of_each_window():
    assert viz_practice.moving_average([1, 2, 3, 4, 5], 3).tolist() == pytest.approx([2, 3, 4])
    assert len(viz_practice.moving_average(np.arange(20.0), 9)) == 12


def test_scaling_rules_plot_one_smoothed_curve_per_rule_and_the_reference():
    reference = made_up_run(1, "linear")
    runs = {rule: made_up_run(8, rule) for rule in ("none", "linear", "sqrt")}
    fig = viz_practice.plot_scaling_rules(reference, runs, window=5)
    (ax,) = fig.axes
    assert len(ax.lines) == 4
    assert all(len(line.get_xdata()) == 20 - 4 for line in ax.lines)  # moving average of 5
    assert ax.lines[0].get_xdata()[0] == reference.samples[4]
    assert legend(ax) == [
        "N=1, B=8, lr 0.02",
        "N=8 (batch 64), none rule: lr 0.02",
        "N=8 (batch 64), linear rule: lr 0.16",
        "N=8 (batch 64), sqrt rule: lr 0.0566",
    ]
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "samples seen"
    assert "moving average of 5 steps" in ax.get_ylabel()
    assert ax.get_title().startswith("Same samples, 8x larger batch")


def test_lr_schedules_plot_a_line_per_schedule():
    steps = np.arange(10)
    schedules = {"warm": [0.1 * s for s in steps], "cold": [1.0] * 10}
    fig = viz_practice.plot_lr_schedules(steps, schedules, "a title")
    (ax,) = fig.axes
    assert [line.get_ydata()[-1] for line in ax.lines] == pytest.approx([0.9, 1.0])
    assert legend(ax) == ["warm", "cold"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "learning rate")
    assert ax.get_title() == "a title"


def test_warmup_plot_draws_every_step_of_the_large_batch_runs():
    small = made_up_run(1, "linear", steps=30)
    cold, warm = made_up_run(32, "linear"), made_up_run(32, "linear", warmup=12)
    fig = viz_practice.plot_warmup_runs(small, [cold, warm])
    (ax,) = fig.axes
    assert len(ax.lines) == 3
    assert len(ax.lines[0].get_xdata()) == 30 - 8  # the small batch, smoothed over 9 steps
    assert [len(line.get_xdata()) for line in ax.lines[1:]] == [20, 20]  # every step
    assert [line.get_marker() for line in ax.lines[1:]] == ["o", "o"]
    assert legend(ax) == ["N=1, lr 0.02 (moving average)", cold.label, warm.label]
    assert ax.get_title() == "N=32, linear rule (lr 0.64): with and without warm-up (measured)"
    assert ax.get_yscale() == "log"


def test_underflow_plot_marks_the_smallest_subnormal():
    magnitudes = np.logspace(-10, 0, 11)
    zeros = {"float16": [1.0] * 3 + [0.0] * 8, "bfloat16": [0.0] * 11}
    fig = viz_practice.plot_underflow(magnitudes, zeros, 2.0**-24)
    (ax,) = fig.axes
    assert len(ax.lines) == 3  # two cases and the threshold
    assert [line.get_linestyle() for line in ax.lines[:2]] == ["-", "--"]
    assert ax.lines[2].get_xdata()[0] == 2.0**-24
    assert legend(ax) == ["float16", "bfloat16", "2**-24"]
    assert ax.get_xscale() == "log" and ax.get_ylabel() == "becomes 0 (1 = yes)"


# chapter 9


def test_memory_per_rank_plot_in_gb_on_log_axes_with_the_gpu_line():
    ns = [1, 2, 4, 8]
    per_rank = {"data parallelism": [16e9] * 4, "stage 3": [16e9 / n for n in ns]}
    fig = viz_zero.plot_memory_per_rank(ns, per_rank, "7.5 B parameters", gpu_bytes=80 * 2**30)
    (ax,) = fig.axes
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert list(ax.lines[1].get_ydata()) == pytest.approx([16, 8, 4, 2])  # GB
    assert ax.lines[2].get_ydata()[0] == pytest.approx(80 * 2**30 / 1e9)  # the GPU
    assert [t.get_text() for t in ax.texts] == ["one 80 GiB GPU"]
    assert legend(ax) == ["data parallelism", "stage 3"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    assert ax.get_title() == "7.5 B parameters"
    no_gpu = viz_zero.plot_memory_per_rank(ns, per_rank, "t", gpu_bytes=None).axes[0]
    assert len(no_gpu.lines) == 2 and not no_gpu.texts


def test_state_per_rank_plot_one_panel_per_world_size_and_bars_per_rank():
    state = {
        2: {"ZeroRedundancyOptimizer": [60, 40], "ShardedOptimizer": [50, 50]},
        3: {"ZeroRedundancyOptimizer": [50, 25, 25], "ShardedOptimizer": [34, 33, 33]},
    }
    fig = viz_zero.plot_state_per_rank(state, unsharded=100, num_params=1234)
    assert [ax.get_title() for ax in fig.axes] == ["N = 2", "N = 3"]
    assert [len(ax.patches) for ax in fig.axes] == [4, 6]  # two optimizers, a bar per rank
    assert fig.axes[0].patches[0].get_height() == pytest.approx(0.6)
    assert [ax.lines[0].get_ydata()[0] for ax in fig.axes] == pytest.approx([1 / 2, 1 / 3])
    assert legend(fig.axes[0]) == ["ZeroRedundancyOptimizer", "ShardedOptimizer"]
    assert fig.axes[0].get_ylabel() == "optimizer state / unsharded"
    assert "1,234 parameters" in fig.get_suptitle()


def test_fsdp_timeline_a_row_per_layer_a_bar_per_event():
    events = [("0", "all-gather", 0.0, 0.002), ("0", "forward", 0.002, 0.003),
              ("1", "all-gather", 0.002, 0.004), ("1", "forward", 0.004, 0.005),
              ("1", "backward", 0.005, 0.007), ("1", "reduce-scatter", 0.007, 0.008),
              ("step", "finished", 0.009, 0.009)]
    fig = viz_zero.plot_fsdp_timeline({"prefetch=True": events, "prefetch=False": events[:3]
                                       + [("step", "finished", 0.005, 0.005)]}, "MLP, 2 ranks")
    top, bottom = fig.axes
    assert len(top.patches) == 6 and len(bottom.patches) == 3
    assert [t.get_text() for t in top.get_yticklabels()] == ["layer 0", "layer 1"]
    assert "synchronised after 9.0 ms" in top.get_title(loc="left")
    (below,) = fig.legends  # under the panels, off the last layer's row
    assert [t.get_text() for t in below.get_texts()] == [
        "all-gather", "forward", "backward", "reduce-scatter"]
    colours = {p.get_facecolor() for p in top.patches}
    assert len(colours) == 4  # forward and backward no longer two similar greys
    assert top.lines[0].get_xdata()[0] == pytest.approx(9.0)


# chapter 10

NS = [1, 2, 4, 8, 16]


def test_weak_scaling_plot_one_panel_per_model_dashed_without_overlap():
    curves = {(net, o): [1.0, 0.9, 0.8, 0.7, 0.6] for net in ("slowest link", "two levels")
              for o in (0.0, 2 / 3)}
    fig = viz_scaling.plot_weak_scaling(NS, {"1.3B": curves, "7B": curves})
    assert [ax.get_title() for ax in fig.axes] == [
        "Modelled: 1.3B in bf16, H100 at 40 % MFU", "Modelled: 7B in bf16, H100 at 40 % MFU"]
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert [line.get_linestyle() for line in ax.lines[:4]] == ["--", "-", "--", "-"]
        assert ax.lines[4].get_ydata()[0] == 0.9  # the 90 % line
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "4", "16"]
    assert legend(fig.axes[0])[:2] == ["slowest link, overlap 0.00", "slowest link, overlap 0.67"]
    assert fig.axes[0].get_ylabel() == "weak-scaling efficiency (modelled)"


def test_weak_vs_strong_plot_labels_the_token_budgets():
    fig = viz_scaling.plot_weak_vs_strong(NS, [1.0] * 5, [1.0, 0.8, 0.6, 0.4, 0.2], 32768,
                                          128 * 32768, "a title")
    (ax,) = fig.axes
    assert legend(ax) == ["weak: 32,768 tokens per GPU", "strong: 4.2M tokens in all"]
    assert [line.get_marker() for line in ax.lines[:2]] == ["o", "s"]
    assert ax.get_xscale() == "log" and ax.get_title() == "a title"
    assert ax.get_ylabel() == "efficiency (modelled)"


def test_gradient_variants_plot_names_the_bucket_counts():
    keys = [(d, b) for d in ("bf16", "fp32") for b in ("25 MiB buckets", "one bucket")]
    eff = {k: [1.0] * 5 for k in keys}
    counts = dict(zip(keys, (100, 1, 199, 1), strict=True))
    fig = viz_scaling.plot_gradient_variants(NS, eff, counts, "a title")
    (ax,) = fig.axes
    assert len(ax.lines) == 4  # no 90 % line on this one
    assert legend(ax) == ["bf16 gradients, 25 MiB buckets (100)", "bf16 gradients, one bucket (1)",
                          "fp32 gradients, 25 MiB buckets (199)", "fp32 gradients, one bucket (1)"]
    assert [line.get_linestyle() for line in ax.lines] == ["-", "-", "--", "--"]
    assert ax.get_xscale() == "log"


def test_measured_scaling_plot_step_times_with_model_bands_and_efficiency():
    ranks = [1, 2, 4]
    step_s = {"weak": [0.010, 0.012, 0.020], "strong": [0.040, 0.025, 0.020]}
    model_s = {"weak": ([0.010, 0.011, 0.015], [0.010, 0.012, 0.018]),
               "strong": ([0.040, 0.021, 0.011], [0.040, 0.022, 0.013])}
    eff = {"weak": [1.0, 0.83, 0.5], "strong": [1.0, 0.8, 0.5]}
    fig = viz_scaling.plot_measured_scaling(ranks, step_s, model_s, eff, "2 CPU cores",
                                            xlabel="ranks N (N = 4 oversubscribed)")
    ax1, ax2 = fig.axes
    assert list(ax1.lines[0].get_ydata()) == pytest.approx([10, 12, 20])  # ms
    assert len(ax1.collections) == 2  # one model band per kind
    (below,) = fig.legends  # one legend under both panels: inside, it covered lines and bands
    assert [t.get_text() for t in below.get_texts()] == [
        "weak: DDP step, measured", "weak: model, overlap 2/3 to 0", "strong: DDP step, measured",
        "strong: model, overlap 2/3 to 0", "weak scaling, measured", "strong scaling, measured"]
    assert ax1.get_title() == "DDP step of the MLP, 2 CPU cores"
    assert ax2.get_ylim() == (0, 1.2)
    assert ax1.get_xlabel() == ax2.get_xlabel() == "ranks N (N = 4 oversubscribed)"


def test_steps_to_target_plot_fit_and_tradeoff_curve():
    batches = [1, 4, 16, 64]
    steps = [2000, 600, 220, 130]
    fig = viz_scaling.plot_steps_to_target(batches, steps, 100.0, 2000.0, 20.0, 0.05, "a title")
    ax1, ax2 = fig.axes
    for ax in (ax1, ax2):
        assert ax.get_xscale() == ax.get_yscale() == "log"
    (below,) = fig.legends
    assert [t.get_text() for t in below.get_texts()][:2] == [
        "measured (best learning rate)", "fit: S_min (1 + 20.0 / B)"]
    assert ax1.lines[2].get_xdata()[0] == 20.0  # B_crit
    assert ax1.get_ylabel() == "steps to loss 0.05" and ax1.get_title() == "a title"
    ratio, examples = ax2.lines[0].get_xdata(), ax2.lines[0].get_ydata()
    assert np.allclose((ratio - 1) * (examples - 1), 1)  # (S/S_min - 1)(E/E_min - 1) = 1
    assert [t.get_text() for t in ax2.texts] == ["1", "4", "16", "64"]  # a batch size per point
    assert list(ax2.lines[1].get_xdata()) == pytest.approx([20, 6, 2.2, 1.3])


def test_two_level_plot_has_bars_per_algorithm_and_the_model_as_ticks():
    result = {"sizes": [2**20, 2**22], "measured": {"flat ring": [0.03, 0.12],
              "two-level": [0.02, 0.09]}, "model": {"flat ring": [0.03, 0.13],
              "two-level": [0.02, 0.09]}}
    fig = viz_scaling.plot_two_level(result, "made up")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 MiB", "4 MiB"]
    assert len(ax.patches) == 4 and ax.get_yscale() == "log"
    assert set(legend(ax)) == {"alpha-beta model (fitted links)", "flat ring, measured",
                               "two-level, measured"}


def test_chapter_11s_strategies_one_panel_each_and_no_figure_hides_its_data():
    from dpcourse.harness import figure_text
    from dpcourse.plots import ddp as viz_ddp
    from dpcourse.plots import sharding_at_scale as viz_scale

    rates = [1e8, 4e8, 4e9]
    runs = [{"rate_bits": r, "measured": {"ddp": 0.1, "fsdp": 0.2, "hsdp": 0.15, "compute": 0.05}}
            for r in rates]
    curves = {"emulated": {s: [0.3, 0.1, 0.06] for s in ("ddp", "fsdp", "hsdp")},
              "a card per GPU": {s: [0.2, 0.08, 0.05] for s in ("ddp", "fsdp", "hsdp")}}
    fig = viz_scale.plot_strategies(runs, curves, rates, "2 nodes x 2 ranks")
    assert [ax.get_title() for ax in fig.axes] == ["DDP", "FSDP", "HSDP"]
    assert all(len(ax.lines) == 4 for ax in fig.axes)  # 2 model views, measured, compute
    events = [("0", "all-gather", 0.0, 0.002), ("0", "forward", 0.002, 0.003),
              ("0", "backward", 0.005, 0.007), ("0", "reduce-scatter", 0.007, 0.008),
              ("step", "finished", 0.009, 0.009)]
    figures = [fig, viz_zero.plot_fsdp_timeline({"a": events, "b": events}, "t"),
               viz_ddp.plot_overlap([0.1, 1], [0.22, 0.23], [0.23, 0.24], [6, 1],
                                    {"none": 0.155, "none + predicted": 0.21}, "t", "s"),
               viz_scaling.plot_steps_to_target([1, 4, 16, 64], [2000, 600, 220, 130], 100.0,
                                                2000.0, 20.0, 0.05, "a title")]
    for each in figures:
        assert figure_text.layout_problems(each) == []


def test_who_holds_what_draws_each_ranks_share_at_each_stage():
    whole = {"parameters": 400, "gradients": 400, "optimizer_state": 800}
    half = {k: v // 2 for k, v in whole.items()}
    held = [{0: whole, 1: dict(whole, optimizer_state=400), 3: half} for _ in range(2)]
    fig = viz_zero.plot_holdings(held)
    assert len(fig.axes) == 3 * 2  # a row per stage, a panel per rank
    stage3_rank1 = fig.axes[5]
    filled = [p for p in stage3_rank1.patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    assert len(filled) == 3 and all(p.get_x() == 0.5 and p.get_width() == 0.5 for p in filled)
    labels = [t.get_text() for t in fig.axes[2].texts]  # stage 1, rank 0, and its name
    assert labels == ["100%", "100%", "50%", "ZeRO-1: optimizer state sharded"]


def test_the_gather_animation_holds_a_layer_from_its_gather_to_its_free():
    events = [("0", "all-gather", 0.000, 0.002), ("0", "forward", 0.002, 0.003),
              ("1", "all-gather", 0.002, 0.004), ("1", "forward", 0.004, 0.005),
              ("1", "all-gather", 0.005, 0.006), ("1", "backward", 0.006, 0.007),
              ("1", "reduce-scatter", 0.007, 0.008), ("0", "all-gather", 0.007, 0.0075),
              ("0", "backward", 0.0075, 0.009), ("0", "reduce-scatter", 0.009, 0.010),
              ("step", "finished", 0.011, 0.011)]
    frames = viz_zero._gathered_over_step(events)
    states = [f["gathered"] for f in frames]
    assert states[0] == {"0": None, "1": None}
    assert {"0": "forward", "1": None} in states and {"0": None, "1": "backward"} in states
    assert {"0": "backward", "1": None} in states and states[-1] == {"0": None, "1": None}
    anim = viz_zero.fsdp_gather_animation(events, 2, "two layers")
    assert anim.to_jshtml().count("data:image/png;base64") >= len(frames)


def test_the_hsdp_mesh_draws_the_groups_the_ranks_report():
    from dpcourse.plots import sharding_at_scale as viz_scale

    ranks = [{"shard_group": [0, 1] if r < 2 else [2, 3], "replicate_group": [r % 2, r % 2 + 2],
              "rows": (6 * (r % 2), 6 * (r % 2) + 6), "of": 12} for r in range(4)]
    fig = viz_scale.plot_hsdp_mesh(ranks)
    (ax,) = fig.axes
    texts = [t.get_text() for t in ax.texts]
    assert "rank 3\nrows 6-11\nof 12" in texts
    assert sum(t.startswith("replicate\ngroup") for t in texts) == 2
    assert sum(t.startswith("node ") for t in texts) == 2
    assert len([line for line in ax.lines if line.get_linestyle() == "--"]) == 2
