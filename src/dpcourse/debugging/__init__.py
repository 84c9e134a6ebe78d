"""The appendices on what goes wrong: the diagnosis lab (slow or hung training) and the bug hunt.

:mod:`.diagnosis` and :mod:`.diagnosis_tools` hold the lab's rank functions and readings (its runs
start ranks from :mod:`dpcourse.harness.runs`); :mod:`.bug_hunt_seed` is the buggy script and
:mod:`.bug_hunt` its fixed twin.

Appendix: the appendices on diagnosing and debugging data-parallel training (the lab, the bug hunt).
"""
