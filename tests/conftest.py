"""Shared test set-up: GPU markers skip, saying why, where the GPUs are missing."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs, found {gpus}"))
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, found none"))
    # The slow tests first: on two workers, one long test started last would keep the run
    # waiting on it alone.
    items.sort(key=lambda item: "slow" not in item.keywords)


# Ranks started once per test process and reused by every test: `run_ranks` runs on an open
# pool of its world size and backend. A failed run restarts that pool's ranks (see RankPool),
# so one test's failure cannot leak into the next (tests/test_shared_pools.py checks it).
SHARED_WORLD_SIZES = (2, 3, 4)


@pytest.fixture(scope="session", autouse=True)
def shared_rank_pools():
    from dpcourse.harness.launch import RankPool

    pools = {n: RankPool(n).start(lazy=True) for n in SHARED_WORLD_SIZES}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def rejects():
    """``rejects(label, fn, *phrases)``: exercise ``label``'s check fails ``fn`` with each of
    ``phrases`` in its message. Where CUDA is in use, or the whole run is under the device audit
    (``make audit-unit``), an answer that mixes devices fails in CUDA's or the audit's words,
    which may come first, instead of those of the check's own model of a GPU, which the phrases
    are written for: there only the failure is asserted."""
    import torch

    from dpcourse.harness import device_audit
    from dpcourse.harness.exercises import run_check

    def check(label: str, fn, *phrases: str) -> str:
        result = run_check(label, fn)
        assert result.status == "failed", result.text()
        if not torch.cuda.is_available() and not device_audit.requested():
            for phrase in phrases:
                assert phrase in result.message, f"{phrase!r} not in: {result.message}"
        return result.message

    return check
