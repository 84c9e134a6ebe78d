"""The diagnosis lab's checks: the right cause passes; plausible wrong causes fail, saying why."""

from __future__ import annotations

import pytest

from dpcourse.debugging import diagnosis
from dpcourse.harness.exercises import registry, run_check
from dpcourse.harness.exercises.core import Exercise


def answer(value):
    return lambda: value


def rejected(label: str, value, *phrases: str) -> str:
    result = run_check(label, answer(value))
    assert result.status == "failed", (value, result)
    for phrase in phrases:
        assert phrase in result.message, (phrase, result.message)
    return result.message


def test_the_lab_registers_four_checks_under_its_own_part():
    lab = {label: ex for label, ex in registry().items() if label.startswith("ex-lab-")}
    assert set(lab) == {"ex-lab-straggler", "ex-lab-hang", "ex-lab-buckets", "ex-lab-bandwidth"}
    assert all(isinstance(ex, Exercise) and ex.part == "lab" and ex.function for ex in lab.values())
    # In the page's order, after every chapter's exercises and before the bug hunt's.
    assert [ex.number for ex in lab.values()] == ["Lab.1", "Lab.2", "Lab.3", "Lab.4"]
    labels = list(registry())
    assert labels[-8:-4] == list(lab) and all(lb.startswith("ex-bugs-") for lb in labels[-4:])


def test_straggler_check():
    right = {"cause": "straggler", "rank": diagnosis.STRAGGLER_RANK}
    assert run_check("ex-lab-straggler", answer(right)).passed
    assert run_check("ex-lab-straggler", answer({"cause": " Straggler ", "rank": 2})).passed
    rejected(
        "ex-lab-straggler",
        {"cause": "slow network", "rank": 2},
        "'slow network'",
        "is not the cause",
        "one rank spends almost no time inside it",
    )
    rejected(
        "ex-lab-straggler",
        {"cause": "shared cores", "rank": 2},
        "is not the cause",
        "the same rank takes tens of milliseconds longer",
    )
    rejected("ex-lab-straggler", {"cause": "small buckets", "rank": 2}, "no small messages")
    rejected("ex-lab-straggler", {"cause": "skipped collective", "rank": 2}, "waiting forever")
    rejected("ex-lab-straggler", {"cause": "straggler", "rank": 0}, "one of the ranks that wait")
    rejected(
        "ex-lab-straggler",
        {"cause": "GiB as GB", "rank": 2},
        "It does not fit what was measured",
        "one before the all-reduce, the others inside it",
    )


def test_hang_check():
    right = {"cause": "skipped collective", "rank": diagnosis.SKIPPING_RANK}
    assert run_check("ex-lab-hang", answer(right)).passed
    rejected(
        "ex-lab-hang",
        {"cause": "straggler", "rank": 1},
        "is not the cause",
        "arrives late, but it arrives",
    )
    rejected(
        "ex-lab-hang",
        {"cause": "timeout too short", "rank": 1},
        "A longer timeout only waits longer",
        "5 minutes",
    )
    rejected("ex-lab-hang", {"cause": "slow network", "rank": 1}, "was never sent")
    rejected("ex-lab-hang", {"cause": "skipped collective", "rank": 0}, "stuck in the all-reduce")
    rejected("ex-lab-hang", {"cause": "skipped collective", "rank": 2}, "missing from the report")


def test_buckets_check():
    assert run_check("ex-lab-buckets", answer("small buckets")).passed
    rejected("ex-lab-buckets", "slow network", "is not the cause", "the bytes move quickly")
    rejected("ex-lab-buckets", "shared cores", "is not the cause", "not the cores")
    rejected("ex-lab-buckets", "straggler", "same model on batches of the same size")
    rejected("ex-lab-buckets", "timeout too short", "Nothing hung")


def test_bandwidth_check():
    right = {"A": "busbw as algbw", "B": "GiB as GB"}
    assert run_check("ex-lab-bandwidth", answer(right)).passed
    assert run_check("ex-lab-bandwidth", answer({"a": "BUSBW as algbw", "b": "gib as gb"})).passed
    swapped = rejected(
        "ex-lab-bandwidth",
        {"A": "GiB as GB", "B": "busbw as algbw"},
        "Report A: 'GiB as GB'",
        "1.500 times the algbw",
        "would make it 0.931 times",
        "Report B: 'busbw as algbw'",
        "0.931 times the algbw",
        "would make it 2(N-1)/N = 1.500 times",
    )
    assert swapped.count("is not the cause") == 2
    rejected(
        "ex-lab-bandwidth", {**right, "A": "bits as bytes"}, "Report A", "would make it 8 times"
    )
    message = rejected(
        "ex-lab-bandwidth", {**right, "B": "warm-up timed"}, "Report B", "lengthen that time"
    )
    assert "Report A" not in message  # only the wrong report is named
    rejected("ex-lab-bandwidth", {**right, "B": "straggler"}, "It does not fit what was measured")


@pytest.mark.parametrize(
    "label, value, phrase",
    [
        ("ex-lab-straggler", "straggler", 'expected a dict {"cause": ..., "rank": ...}'),
        ("ex-lab-straggler", {"cause": "straggler", "rank": 3}, "a rank from 0 to 2"),
        ("ex-lab-hang", {"cause": "deadlock", "rank": 1}, "one of the keys of diagnosis.CAUSES"),
        ("ex-lab-buckets", 3, "one of the keys of diagnosis.CAUSES"),
        ("ex-lab-bandwidth", {"A": "GiB as GB"}, 'expected a dict {"A": ..., "B": ...}'),
    ],
)
def test_answers_of_the_wrong_form_say_what_is_expected(label, value, phrase):
    rejected(label, value, phrase)


def test_every_answer_is_a_cause_the_lab_lists():
    answers = {"straggler", "skipped collective", "small buckets", "busbw as algbw", "GiB as GB"}
    assert answers <= set(diagnosis.CAUSES)
