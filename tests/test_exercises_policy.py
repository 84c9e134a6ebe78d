"""The student edition carries a policy for coding assistants (AGENTS.md, issue 43): a tutor
that explains and points to the section, never the author of an exercise's answer; the website
built from the edition does not show it as a page, and the full edition does not carry it."""

from __future__ import annotations

from pathlib import Path

import yaml

from dpcourse.harness.exercises.student import (
    ASSISTANT_POLICY,
    make_student_edition,
    write_assistant_policy,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_student_edition_carries_the_policy(tmp_path):
    make_student_edition(ROOT, tmp_path / "student")
    policy = (tmp_path / "student" / "AGENTS.md").read_text()
    assert policy == ASSISTANT_POLICY
    for rule in ("Act as a tutor", "point to the", "Never", "Write, complete, fix or rewrite the "
                 "body of an exercise's function", "Edit, skip or disable a check cell",
                 "NotImplementedError"):
        assert rule in " ".join(policy.split()), rule
    config = yaml.safe_load((tmp_path / "student" / "_config.yml").read_text())
    assert "AGENTS.md" in config["exclude_patterns"]  # not a page of the student website
    assert config["sphinx"]["config"]["hide_solutions"] is True  # the rest as before


def test_writing_the_policy_twice_lists_it_once(tmp_path):
    (tmp_path / "_config.yml").write_text("# a comment kept\ntitle: x\n")
    write_assistant_policy(tmp_path)
    write_assistant_policy(tmp_path)
    text = (tmp_path / "_config.yml").read_text()
    assert text.startswith("# a comment kept\n")
    assert yaml.safe_load(text)["exclude_patterns"] == ["AGENTS.md"]

