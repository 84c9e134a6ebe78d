"""The launcher's promises (see the docstring of dpcourse.harness.launch), one test each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dpcourse import runtime
from dpcourse.harness import device_audit, launch
from dpcourse.harness.launch import (
    RankDiedError,
    RankError,
    RankPool,
    RankTimeoutError,
    forkserver,
    run_ranks,
)


def proc_state(pid: int | str) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return stat[0], int(stat[1])


def live_workers(keep: frozenset[int] = frozenset()) -> list[int]:
    """Pids of this test process's dpcourse rank processes still alive (zombies excluded), from
    /proc, but those in ``keep`` (the ranks of the session's shared pools). A rank is a child of
    this process running the worker, or a child of this process's fork server."""
    server = forkserver.server_pid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (found := proc_state(entry.name)) is None:
            continue
        state, parent = found
        spawned = b"dpcourse.harness.launch.worker" in cmdline and parent == os.getpid()
        if state != "Z" and (spawned or parent == server):
            pids.append(int(entry.name))
    return pids


@pytest.fixture(autouse=True)
def no_leftover_ranks(shared_rank_pools):
    yield
    keep = frozenset(pid for pool in shared_rank_pools.values() for pid in pool.pids)
    deadline = time.monotonic() + 5
    while live_workers(keep) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_workers(keep) == [], "a test left rank processes behind"


pytestmark = pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")


# ---------------------------------------------------------------- results, arguments, collectives
def rank_and_sum(offset, scale=1.0):
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)], device=runtime.device())
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_ranks(rank_and_sum, world_size, 1, scale=2.0)
    total = sum(r + 1 for r in range(world_size)) * 2.0
    assert results == [(r, world_size, total) for r in range(world_size)]


def test_rank_sees_runtime_info_and_one_thread():
    def info():
        from dpcourse import runtime

        i = runtime.current()
        return i.rank, i.world_size, i.backend, str(i.device), torch.get_num_threads()

    results = run_ranks(info, 2)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    # NCCL where every rank has a GPU (under the device audit: on the machine it models)
    expected_backend = runtime.choose_backend(2)
    assert {r[2] for r in results} == {expected_backend}
    assert [r[3] for r in results] == [
        str(runtime.device_for_rank(r, 2, expected_backend)) for r in range(2)
    ]
    assert {r[4] for r in results} == {1}


def test_tensors_travel_both_ways():
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)

    def double(t):
        return t * 2

    out = run_ranks(double, 2, x)
    for t in out:
        torch.testing.assert_close(t, x * 2, rtol=0, atol=0)


# ------------------------------------------------------------------- functions defined anywhere
def test_closure_and_lambda_defined_here_run_by_value():
    factor = 7
    assert run_ranks(lambda: factor * 6, 2) == [42, 42]


def test_function_from_script_main_runs(tmp_path):
    # No `if __name__ == "__main__"` guard on purpose: the ranks must not re-run the script.
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        from dpcourse.harness.launch import run_ranks
        import torch.distributed as dist

        def work():
            return dist.get_rank() * 10

        print("RESULT", run_ranks(work, 3))
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [0, 10, 20]" in proc.stdout


def test_function_defined_in_a_notebook_cell_runs_on_four_ranks(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            textwrap.dedent("""
            import torch, torch.distributed as dist
            from dpcourse.harness.launch import run_ranks

            def square_and_sum():
                from dpcourse import runtime

                t = torch.tensor([float(dist.get_rank()) ** 2], device=runtime.device())
                dist.all_reduce(t)
                return t.item()

            results = run_ranks(square_and_sum, 4)
            assert results == [14.0] * 4, results
            print("OK", results)
        """)
        ),
        nbformat.v4.new_code_cell(
            textwrap.dedent("""
            def broken():
                x = 1
                raise ValueError(f"bad value {x}")

            try:
                run_ranks(broken, 2)
            except Exception as e:
                message = str(e)
            assert 'raise ValueError(f"bad value {x}")' in message, message
            print("SOURCE LINE SHOWN")
        """)
        ),
    ]
    nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.outputs)
    assert "OK [14.0, 14.0, 14.0, 14.0]" in text
    assert "[rank" not in text  # nothing printed by the ranks here
    assert "SOURCE LINE SHOWN" in text


# ---------------------------------------------------------------------------------- ports
def test_two_runs_at_once_and_back_to_back_do_not_collide():
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def job(key):
        try:
            results[key] = run_ranks(rank_and_sum, 2, key)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(k,)) for k in (0, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == [(0, 2, 1.0), (1, 2, 1.0)]
    assert results[10] == [(0, 2, 21.0), (1, 2, 21.0)]
    for _ in range(3):  # the port of a finished run is free again at once
        assert run_ranks(rank_and_sum, 2, 0)[0] == (0, 2, 1.0)


# --------------------------------------------------------------------------------- output
def test_prints_reach_the_caller_with_rank_prefix(capfd):
    def talk():
        import torch.distributed as dist

        print(f"hello from {dist.get_rank()}")
        print("to stderr", file=sys.stderr)

    run_ranks(talk, 3)
    out, err = capfd.readouterr()
    for r in range(3):
        assert f"[rank {r}] hello from {r}" in out
        assert f"[rank {r}] to stderr" in err


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("world_size,bad_rank", [(1, 0), (2, 1), (4, 2)])
def test_exception_in_a_rank_is_raised_with_rank_and_traceback(world_size, bad_rank):
    def maybe_fail(bad):
        import torch.distributed as dist

        if dist.get_rank() == bad:
            raise ValueError(f"rank {bad} got a bad shard")
        dist.barrier()  # the others wait for the failed rank: they must be killed, not hang
        return "ok"

    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(maybe_fail, world_size, bad_rank, timeout=60)
    err = info.value
    assert time.monotonic() - start < 30
    assert err.rank == bad_rank and err.world_size == world_size
    assert isinstance(err.original, ValueError)
    text = str(err)
    assert (
        f"rank {bad_rank} of {world_size} raised ValueError: rank {bad_rank} got a bad shard"
        in text
    )
    assert "in maybe_fail" in text and 'raise ValueError(f"rank {bad} got a bad shard")' in text
    assert "_launch/worker.py" not in text  # the launcher's own frames are hidden


def test_unpicklable_arguments_fail_before_starting_ranks():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="could not send"):
        run_ranks(lambda lk: None, 2, lock)


def test_unpicklable_result_names_the_rank():
    def returns_lock():
        return threading.Lock()

    with pytest.raises(RankError, match="could not be sent back"):
        run_ranks(returns_lock, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_world_size_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(rank_and_sum, bad, 0)


def test_not_callable_is_a_clear_error():
    with pytest.raises(TypeError, match="callable"):
        run_ranks(42, 2)


def test_nccl_without_enough_gpus_is_a_clear_error():
    # One rank more than this node's GPUs (under the device audit: the modelled machine's).
    if device_audit.requested():
        gpus = device_audit.modelled_gpus()
        if gpus is None:
            pytest.skip(f"the modelled machine ({device_audit.machine()}) has a GPU per rank")
    else:
        gpus = runtime.gpu_count()
    world_size = max(2, gpus + 1)
    expected = f"NCCL needs one GPU per rank, but this node runs {world_size} ranks and has {gpus}"
    with pytest.raises(RuntimeError, match=expected):
        run_ranks(rank_and_sum, world_size, 0, backend="nccl")


# ------------------------------------------------------------------------- deaths and stalls
@pytest.mark.parametrize(
    "how,expected",
    [
        ("exit", "exited with code 3"),
        ("kill", "killed by SIGKILL"),
        ("segv", "killed by SIGSEGV"),
    ],
)
def test_a_rank_that_dies_is_reported_and_the_others_are_killed(how, expected):
    def die(how):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            print("about to die", file=sys.stderr, flush=True)
            if how == "exit":
                os._exit(3)
            sig = signal.SIGKILL if how == "kill" else signal.SIGSEGV
            os.kill(os.getpid(), sig)
        time.sleep(600)

    start = time.monotonic()
    with pytest.raises(RankDiedError) as info:
        run_ranks(die, 3, how, timeout=60)
    assert time.monotonic() - start < 20
    assert info.value.rank == 1
    assert expected in str(info.value)
    assert "about to die" in str(info.value)  # the rank's last stderr lines come along
    assert "still running and were killed" in str(info.value)


def test_a_stalled_rank_times_out_with_its_stack():
    def stall():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(600)  # never joins the barrier
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(stall, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert elapsed < 15, elapsed
    err = info.value
    assert err.stalled == [0, 1]
    assert isinstance(err, TimeoutError)
    text = str(err)
    assert "timeout of 3 s" in text
    assert "--- rank 1 was here" in text and "time.sleep(600)" in text
    assert "--- rank 0 was here" in text and "dist.barrier()" in text


# ------------------------------------------------------------------------------- teardown
def test_repeated_launches_tear_down_cleanly(recwarn):
    # pyproject turns the launcher's "did not shut down cleanly" RuntimeWarning into an error.
    for i in range(8):
        assert run_ranks(rank_and_sum, 2, i)[1][2] == 2 * i + 1
    assert not [w for w in recwarn if "shut down" in str(w.message)]


def _leaving_hangs() -> None:
    """In this rank, leaving the process group takes longer than the launcher waits (NCCL's
    destroy did on the H200, for a lone rank)."""
    runtime.teardown = lambda: time.sleep(60)


def test_a_rank_that_cannot_leave_its_group_still_exits_in_time(recwarn):
    """tests/test_train_cli.py's fixture on the H200: 'ranks did not shut down cleanly: rank 0:
    still running, killed'. A rank waits 5 s to leave its group, then exits all the same."""
    pool = RankPool(1)
    pool.run(_leaving_hangs)
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 12  # the launcher waits 15 s before it kills
    assert not [w for w in recwarn if "shut down" in str(w.message)]


# ----------------------------------------------------------------------------------- pool
def test_pool_keeps_ranks_alive_and_run_ranks_uses_it():
    def pid():
        return os.getpid()

    with RankPool(3) as pool:
        first = run_ranks(pid, 3)
        assert first == pool.pids
        assert run_ranks(pid, 3) == first  # same processes: no start-up cost
        assert pool.run(rank_and_sum, 1)[2] == (2, 3, 6.0)
        other = run_ranks(pid, 2)  # another world size gets its own, short-lived ranks
        assert set(other).isdisjoint(first)
    assert pool.pids == []
    assert pool not in launch._open_pools


def test_keep_ranks_reuses_started_ranks_and_closes_the_oldest(monkeypatch):
    def pid():
        return os.getpid()

    monkeypatch.setenv("DPCOURSE_KEEP_RANKS", "1")
    try:  # sizes 1 and 5: the session's shared pools (2, 3, 4) would take the others
        first = run_ranks(pid, 5)
        assert run_ranks(pid, 5) == first  # kept: the same processes
        other = run_ranks(pid, 1)  # a second world size: the 5-rank pool is closed
        assert set(other).isdisjoint(first) and run_ranks(pid, 1) == other
        assert set(first).isdisjoint(live_workers())
        assert len(launch._kept_pools) == 1
    finally:
        while launch._kept_pools:
            launch._kept_pools.pop().close()


def test_keep_ranks_must_be_a_number(monkeypatch):
    monkeypatch.setenv("DPCOURSE_KEEP_RANKS", "yes")
    with pytest.raises(ValueError, match="DPCOURSE_KEEP_RANKS must be a number"):
        run_ranks(os.getpid, 5)


def test_pool_recovers_after_a_failed_run():
    def fail_on_rank_0():
        import torch.distributed as dist

        if dist.get_rank() == 0:
            raise KeyError("missing")
        dist.barrier()

    def pid():
        return os.getpid()

    with RankPool(2) as pool:
        before = pool.run(pid)
        with pytest.raises(RankError, match="KeyError"):
            pool.run(fail_on_rank_0)
        after = pool.run(pid)  # fresh ranks, working again
        assert set(after).isdisjoint(before)
        assert pool.run(rank_and_sum, 0)[0] == (0, 2, 1.0)


def test_pool_timeout_then_recovers():
    with RankPool(2) as pool:
        with pytest.raises(RankTimeoutError):
            pool.run(time.sleep, 600, timeout=1)
        assert pool.run(rank_and_sum, 0)[1] == (1, 2, 1.0)


# --------------------------------------------------------------------- how ranks are started
def parent_of(pid: int) -> int:
    return proc_state(pid)[1]


def test_ranks_fork_from_the_server_or_start_fresh_as_asked(monkeypatch):
    with RankPool(2) as pool:
        assert {parent_of(p) for p in pool.pids} == {forkserver.server_pid()}
        assert pool.run(rank_and_sum, 0)[1] == (1, 2, 1.0)
    monkeypatch.setenv("DPCOURSE_START_METHOD", "spawn")
    with RankPool(2) as pool:
        assert {parent_of(p) for p in pool.pids} == {os.getpid()}
        assert pool.run(rank_and_sum, 0)[1] == (1, 2, 1.0)
    monkeypatch.setenv("DPCOURSE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="'forkserver' or 'spawn'"):
        forkserver.start_method()


def test_forked_ranks_see_the_callers_environment_of_now(monkeypatch):
    def variables():
        return os.environ.get("DPCOURSE_TEST_NOTE"), os.environ.get("OMP_SCHEDULE")

    with RankPool(1) as pool:
        pool.run(os.getpid)  # the server is running now
    monkeypatch.setenv("DPCOURSE_TEST_NOTE", "set after the server started")
    with RankPool(1) as pool:
        assert parent_of(pool.pids[0]) == forkserver.server_pid()  # forked ...
        assert pool.run(variables) == [("set after the server started", None)]  # ... and sees it
    # A variable that torch's import reads: a fork would not see it, so the rank is spawned.
    monkeypatch.setenv("OMP_SCHEDULE", "static")
    assert forkserver.start_method() == "spawn"
    with RankPool(1) as pool:
        assert parent_of(pool.pids[0]) == os.getpid()
        assert pool.run(variables) == [("set after the server started", "static")]


def test_ranks_end_when_the_caller_is_killed(tmp_path):
    """Forked ranks: their parent, the fork server, exits with the caller (spawned ranks run
    the same watch on their parent, the caller itself)."""
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent("""
        import time
        from dpcourse.harness.launch import RankPool

        pool = RankPool(2).start()
        print("PIDS", *pool.pids, flush=True)
        time.sleep(600)
    """)
    )
    caller = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = caller.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        caller.kill()  # like a notebook kernel that is killed: no clean-up code runs
        caller.wait(10)

        def alive(pid):
            return (proc_state(pid) or ("Z", 0))[0] != "Z"

        deadline = time.monotonic() + 10
        while any(map(alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, pids)), "ranks outlived their killed caller"
    finally:
        caller.kill()
