"""Checks for the diagnosis lab's exercises (the appendix "diagnosing slow or hung training").

Each exercise asks the learner to name the cause of one injected fault with a key of
:data:`dpcourse.debugging.diagnosis.CAUSES` (and, where it matters, a rank). A check accepts the
right cause and answers every other one with why the measurement rules it out.

The appendix has no chapter number of its own: its labels are ``ex-lab-<slug>`` and its
exercises are numbered Lab.1 to Lab.4 (:mod:`dpcourse.harness.exercises.numbering`), which is
what the grader, the registry's order and the checks' messages go by.

Appendix: the diagnosis lab (exercise checks).
"""

from __future__ import annotations

from collections.abc import Callable

from dpcourse.debugging import diagnosis
from dpcourse.debugging.diagnosis import CAUSES
from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise


def _cause(value: object, where: str = "the cause") -> str:
    """The key of CAUSES that ``value`` names (case and spaces aside), or a Mismatch."""
    if isinstance(value, str):
        for key in CAUSES:
            if value.strip().lower() == key.lower():
                return key
    raise Mismatch(
        f"{where}: expected one of the keys of diagnosis.CAUSES "
        f"({', '.join(repr(k) for k in CAUSES)}), got {value!r}"
    )


def _cause_and_rank(fn: Callable, world_size: int) -> tuple[str, int]:
    got = call_learner(fn)
    if not isinstance(got, dict) or set(got) != {"cause", "rank"}:
        raise Mismatch(f'expected a dict {{"cause": ..., "rank": ...}}, got {got!r}')
    rank = got["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise Mismatch(f"the rank: expected a rank from 0 to {world_size - 1}, got {rank!r}")
    return _cause(got["cause"]), rank


def _rejected(cause: str, reasons: dict[str, str], evidence: str) -> Mismatch:
    why = reasons.get(cause, f"It does not fit what was measured. {evidence}")
    return Mismatch(f"{cause!r} ({CAUSES[cause]}) is not the cause. {why}")


STRAGGLER_EVIDENCE = (
    "Every rank finished every step, and the ranks differ in where they spend it: one before "
    "the all-reduce, the others inside it."
)
STRAGGLER_REASONS = {
    "slow network": (
        "A slow link would slow the all-reduce on every rank alike. Here one rank spends almost "
        "no time inside it, because it arrives last; the others wait there about as long as that "
        "rank spends before it. Time inside an all-reduce is mostly waiting for the last rank."
    ),
    "shared cores": (
        "Three ranks do share two cores, but contention would stretch every rank's compute, now "
        "one and now another; here the same rank takes tens of milliseconds longer before the "
        "all-reduce at every step while the others compute in about a millisecond."
    ),
    "small buckets": (
        "Each step sends the whole gradient in one all-reduce: there are no small messages, and "
        "on the rank that arrives last the all-reduce is short."
    ),
    "skipped collective": (
        "Every rank finished every step. A skipped collective leaves the others waiting forever "
        "(fault 2); it does not slow every step by the same amount."
    ),
}


@exercise("ex-lab-straggler", function="my_straggler_diagnosis", timeout=10)
def straggler_cause(fn: Callable) -> str:
    """``fn()`` returns ``{"cause": <a key of CAUSES>, "rank": <the rank at fault>}`` for the
    lab's first run."""
    cause, rank = _cause_and_rank(fn, diagnosis.LAB_WORLD_SIZE)
    if cause != "straggler":
        raise _rejected(cause, STRAGGLER_REASONS, STRAGGLER_EVIDENCE)
    if rank != diagnosis.STRAGGLER_RANK:
        raise Mismatch(
            f"The cause is right, but rank {rank} is one of the ranks that wait: a rank that "
            "spends long inside the all-reduce got there early. The straggler is the rank with "
            "the longest time before the all-reduce and the shortest inside it."
        )
    return "the straggler, found from where each rank spends its step"


HANG_EVIDENCE = (
    "The run did not finish: some ranks sat inside one all-reduce for the whole timeout while "
    "another had returned from the training function."
)
HANG_REASONS = {
    "straggler": (
        "A straggler arrives late, but it arrives. Here one rank had already returned from the "
        "training function (it printed that it finished, and it is not among the stalled ranks), "
        "so no amount of waiting brings it into the all-reduce the others are in."
    ),
    "timeout too short": (
        "A longer timeout only waits longer: the stalled ranks are all inside an all-reduce that "
        "a rank which has already returned will never join. (Without the launcher's timeout, "
        "gloo gives up after the process group's timeout, 5 minutes here, with an error.)"
    ),
    "slow network": (
        "A slow link makes a collective slow but still completes it. Here the stalled ranks sat "
        "in one all-reduce for the whole timeout while another rank had finished: the data they "
        "wait for was never sent."
    ),
}


@exercise("ex-lab-hang", function="my_hang_diagnosis", timeout=10)
def hang_cause(fn: Callable) -> str:
    """``fn()`` returns ``{"cause": <a key of CAUSES>, "rank": <the rank at fault>}`` for the
    lab's second run (the one the timeout ended)."""
    cause, rank = _cause_and_rank(fn, diagnosis.LAB_WORLD_SIZE)
    if cause != "skipped collective":
        raise _rejected(cause, HANG_REASONS, HANG_EVIDENCE)
    if rank != diagnosis.SKIPPING_RANK:
        raise Mismatch(
            f"The cause is right, but rank {rank} is one of the ranks stuck in the all-reduce "
            "(its stack is in the report). The rank at fault is the one missing from the "
            "report: it returned early, having made one all-reduce fewer than the others."
        )
    return "the skipped collective, found from who is stuck where and who is not"


BUCKET_EVIDENCE = (
    "Every step finished but slowly, and the colleague's DDP makes dozens of all-reduces per "
    "step where one all-reduce of the whole gradient takes about a millisecond."
)
BUCKET_REASONS = {
    "slow network": (
        "One all-reduce of the whole gradient (0.7 MB) takes about a millisecond or less here, "
        "not many times one of 4 bytes: the bytes move quickly. What costs is the count, one "
        "all-reduce per parameter tensor, each paying a fixed latency."
    ),
    "shared cores": (
        "The two ranks do share the two cores, but with the default 25 MB cap the same two "
        "ranks, on the same cores and batches, step much faster. What the bucket cap "
        "changes is the number of all-reduces per step, not the cores."
    ),
    "straggler": (
        "Both ranks run the same model on batches of the same size, and the extra time grows "
        "with the number of all-reduces per step; a straggler would add its own delay, "
        "whatever the messages."
    ),
    "skipped collective": "Nothing hung: every step finished, only slowly.",
    "timeout too short": "Nothing hung: every step finished, only slowly.",
}


@exercise("ex-lab-buckets", function="my_buckets_diagnosis", timeout=10)
def buckets_cause(fn: Callable) -> str:
    """``fn()`` returns the key of CAUSES that explains the slow DDP of the lab's third run."""
    cause = _cause(call_learner(fn))
    if cause != "small buckets":
        raise _rejected(cause, BUCKET_REASONS, BUCKET_EVIDENCE)
    return "small buckets: many all-reduces per step, each paying the latency"


def _bandwidth_reasons(report: str, ratio: float, n: int) -> dict[str, str]:
    """Why each wrong cause cannot explain a report whose figure is ``ratio`` times the algbw
    in GB/s that its own bytes and time give."""
    busbw, gib = 2 * (n - 1) / n, 1e9 / 2**30
    shown = f"Report {report}'s figure is {ratio:.3f} times the algbw its own bytes and time give"
    return {
        "busbw as algbw": f"{shown}; printing busbw would make it 2(N-1)/N = {busbw:.3f} times.",
        "GiB as GB": f"{shown}; dividing by 2**30 instead of 10**9 would make it {gib:.3f} times.",
        "bits as bytes": f"{shown}; bits for bytes would make it 8 times (or 1/8).",
        "warm-up timed": (
            f"{shown}, though it prints the time it used: a warm-up inside the timing would "
            "lengthen that time, not change how the figure follows from it."
        ),
    }


@exercise("ex-lab-bandwidth", function="my_bandwidth_diagnosis", timeout=10)
def bandwidth_mistakes(fn: Callable) -> str:
    """``fn()`` returns ``{"A": <a key of CAUSES>, "B": <a key of CAUSES>}``: the mistake in each
    colleague's report of the lab's fourth measurement."""
    got = call_learner(fn)
    if not isinstance(got, dict) or {str(k).upper() for k in got} != {"A", "B"}:
        raise Mismatch(f'expected a dict {{"A": ..., "B": ...}}, got {got!r}')
    got = {str(k).upper(): v for k, v in got.items()}
    n = diagnosis.BANDWIDTH_WORLD_SIZE
    ratios = {"A": 2 * (n - 1) / n, "B": 1e9 / 2**30}
    right = {"A": "busbw as algbw", "B": "GiB as GB"}
    problems = []
    for report in ("A", "B"):
        cause = _cause(got[report], f"report {report}")
        if cause != right[report]:
            reasons = _bandwidth_reasons(report, ratios[report], n)
            evidence = reasons["warm-up timed"].split(",")[0] + "."
            problems.append(f"Report {report}: {_rejected(cause, reasons, evidence)}")
    if problems:
        raise Mismatch(" ".join(problems))
    return "both mistakes named, from the ratio of each figure to bytes / time"
