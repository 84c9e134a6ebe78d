"""The time and memory a command takes, with every process it starts: for choosing the grader's
limits (the instructor guide's Gradescope section quotes what this printed).

    python tools/grading_footprint.py -- python -m dpcourse.harness.exercises grade s.ipynb ...

prints the wall-clock seconds and the peak of the summed resident memory of the command and its
descendants (sampled every 0.1 s, so a peak shorter than that can be missed; RSS counts shared
pages once per process, so the sum overstates what the machine needs a little).
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
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
        except psutil.NoSuchProcess:
            break
        peak = max(peak, total)
        time.sleep(0.1)
    rc = proc.wait()
    wall = time.monotonic() - started
    print(f"footprint: {wall:.1f} s wall-clock, peak memory {peak / 2**20:.0f} MiB "
          f"(the command and its processes, summed), exit status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
