"""The time and memory a command takes, with every process it starts: for choosing the grader's
limits (the instructor guide's Gradescope section quotes what this printed).

    python tools/grading_footprint.py -- python -m dpcourse.harness.exercises grade s.ipynb ...

prints the wall-clock seconds and the peak memory of the command and its descendants, summed,
sampled every 0.2 s (a peak shorter than that can be missed): as resident set sizes (RSS, which
count the pages that processes forked from one another share once per process, so that their
sum overstates what the machine needs) and as proportional set sizes (PSS, which share those
pages out: what a container's memory limit sees, near enough).
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil  # ipykernel's dependency, installed with the notebooks


def main(argv: list[str]) -> int:
    if "--" in argv:
        argv = argv[argv.index("--") + 1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.monotonic()
    proc = subprocess.Popen(argv)
    root = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    info = p.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
        except psutil.NoSuchProcess:
            break
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.2)
    rc = proc.wait()
    wall = time.monotonic() - started
    print(f"footprint: {wall:.1f} s wall-clock, peak memory {peak_pss / 2**20:.0f} MiB PSS "
          f"({peak_rss / 2**20:.0f} MiB RSS), the command and its processes summed; exit "
          f"status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
