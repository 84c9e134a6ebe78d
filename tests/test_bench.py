"""The benchmark command runs and records what it measured (its numbers are not judged here)."""

from __future__ import annotations

import json
import re

from dpcourse.harness import bench


def test_launch_benchmark_writes_json(tmp_path, capsys):
    out = tmp_path / "launch.json"
    assert bench.main(["launch", "--world-sizes", "2", "--repeats", "1", "--warm-repeats", "2",
                       "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "launch" and record["machine"]["cpus"] >= 1
    (row,) = record["rows"]
    assert row["world_size"] == 2
    assert row["cold_over_spawn"] == row["run_ranks_cold_s"] / row["torch_spawn_s"] > 0
    assert "forked/spawn" in capsys.readouterr().out


def test_every_benchmark_module_is_found():
    found = bench.benchmarks()
    assert {"launch", "allreduce"} <= set(found)
    for module in found.values():
        assert module.HELP and module.__doc__


def test_allreduce_benchmark_prints_ratios(tmp_path, capsys):
    out = tmp_path / "ar.json"
    assert bench.main(["allreduce", "--world-size", "2", "--repeats", "2", "--largest", "4096",
                       "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["bytes"] for r in record["rows"]] == [1024, 4096]
    for r in record["rows"]:
        assert r["library_over_library"] == 1.0 and r["ring_over_library"] > 0
    assert "ring/lib" in capsys.readouterr().out


def test_recorded_results_are_found_with_their_machine_and_date():
    record = bench.recorded("cluster-4")
    # a record keeps the command that made it: runs from before the package's re-layout (0.2.0)
    # say `python -m dpcourse.bench`, later ones `python -m dpcourse.harness.bench`
    assert re.match(r"python -m dpcourse(\.harness)?\.bench cluster ", record["command"])
    assert record["date"] and record["machine"]["cpus"] >= 1
    assert bench.recorded("no-such-benchmark") is None


def test_fsdp_benchmark_times_ours_against_fully_shard(tmp_path, capsys):
    out = tmp_path / "fsdp.json"
    assert bench.main(["fsdp", "--world-sizes", "2", "--repeats", "1", "--warmup", "1",
                       "--width", "64", "--out-features", "33", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["variant"] for r in record["rows"]] == ["fully_shard", "FSDP", "FSDP no prefetch"]
    assert record["rows"][0]["over_fully_shard"] == 1.0
    assert all(r["median_s"] > 0 for r in record["rows"])
    assert "/fully_shard" in capsys.readouterr().out
