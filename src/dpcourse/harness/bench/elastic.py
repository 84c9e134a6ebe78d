"""``python -m dpcourse.harness.bench elastic``: training that survives a lost node, timed.

Two torchrun agents, one per emulated node (:class:`dpcourse.harness.launch.TorchrunAgents`),
with ``--max-restarts`` and a c10d rendezvous hosted by node 0's agent, train chapter 8's model
with ``python -m dpcourse.practice.train`` (``ddp-scratch``, a checkpoint every 4 steps, a
collective timeout of 5 s). Once the checkpoint of step 4 is written, node 1 fails:

* ``kill``: every process of node 1 is killed; node 0's worker reads "Connection reset by
  peer", its agent restarts it and waits at the rendezvous until a replacement agent, started
  on node 1 as a scheduler would start one on a spare machine, joins; both resume from step 4;
* ``cut``: node 1's link is cut for ``--outage`` seconds; both workers' all-reduces time out,
  both agents restart their workers, and once the link is back they meet again and resume;
* ``shrink``: ``--nnodes=1:2``; node 1 is killed and not replaced: node 0's agent goes on
  alone after the rendezvous' last call, and the trainer resumes on one rank
  (``--allow-resize``: world size, global batch and learning rate change).

Each run is set beside a run of the same command on two ranks without a fault: ``kill`` and
``cut`` must end with its weights bit for bit (the weights' hash, which the trainer checks
across ranks), ``shrink`` on one rank. Reports the seconds from the fault to the resume line
and to the end. ``make faults`` records it in ``benchmarks/cpu-2core/elastic.json``; chapter 8
shows that run where it cannot build the cluster.

Chapter 8: training at scale in practice (failures across nodes).
"""

from __future__ import annotations

import argparse
import datetime
import re
import tempfile
import time
from pathlib import Path

from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch import TorchrunAgents, run_ranks
from dpcourse.practice import checkpoint, train

HELP = "torchrun agents on two emulated nodes survive a killed node, a cut link, a lost node"
_SCENARIOS = ("kill", "cut", "shrink")
# The trainer's command, shared by the run without a fault and the elastic ones.
COMMON = ["--strategy", "ddp-scratch", "--steps", "12", "--batch-size", "8", "--num-samples",
          "256", "--lr-scaling", "linear", "--log-every", "2", "--checkpoint-every", "4",
          "--timeout", "5"]
_FAULT_AFTER_STEP = 4
# The c10d rendezvous: wait up to 60 s for the nodes to join; go on 2 s after the last one
# came (--nnodes=1:2); an agent that has not sent a heartbeat for 5 x 1 s is taken as dead
# (torch's defaults, 5 s x 3, kept the survivor of a killed node waiting 11.6 s here).
_RDZV_CONF = {"join_timeout": 60, "last_call_timeout": 2, "keep_alive_interval": 1,
             "keep_alive_max_attempt": 5}
_WEIGHTS = re.compile(r"\(weights ([0-9a-f]{16})\)")
# What the trainer prints, and the agent's log lines (LOGLEVEL=INFO) that tell its story.
_KEPT = ("training ", "step ", "resumed", "resized", "done:", "Error:", "failed (exitcode",
         "Worker group FAILED", "Rendezvous'ing", "Rendezvous complete", "group_world_size",
         "successfully finished")
# torchrun's log prefix: level, date, time, pid, source file and line
_AGENT_LINE = re.compile(r"^([IWE])\d{4} (\d\d:\d\d:\d\d\.\d{3})\d* +\d+ \S+\] (.*)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", nargs="+", choices=_SCENARIOS, default=list(_SCENARIOS))
    parser.add_argument("--outage", type=float, default=8.0,
                        help="seconds the link stays cut in the cut scenario")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each run")


def straight_fingerprint(workdir: Path) -> str:
    """The weights' hash of the trainer's run on two ranks without a fault."""
    runs = run_ranks(train.main, 2, [*COMMON, "--checkpoint-dir", str(workdir / "straight")],
                     timeout=300)
    return runs[0]["fingerprint"]


def shown(text: str) -> list[str]:
    """The lines of an agent's output that tell the story (steps, errors, restarts,
    rendezvous, resumes), the agent's own with their time and without torch's source path."""
    lines = []
    for line in text.splitlines():
        if not any(k in line for k in _KEPT) or "hostname of the client" in line:
            continue
        line = re.sub(r"/\S*/(elastic-\w+/step-\d+)", r"<dir>/\1", line)
        agent = _AGENT_LINE.match(line)
        if agent:
            line = f"{agent[2]} agent: {agent[3].strip()}"
        line = line.split(". This is typically caused")[0]
        lines.append(re.sub(r"\[/\S+/third_party/gloo/", "[gloo/", line)[:200])
    return lines


def _agent_times(text: str) -> dict[str, str]:
    """The clock time (HH:MM:SS.mmm) of the first "Worker group FAILED" and of the next
    "Rendezvous complete" in an agent's output (LOGLEVEL=INFO)."""
    times: dict[str, str] = {}
    for line in text.splitlines():
        agent = _AGENT_LINE.match(line)
        if agent and "Worker group FAILED" in line and "failed" not in times:
            times["failed"] = agent[2]
        elif agent and "Rendezvous complete" in line and "failed" in times:
            times.setdefault("rendezvous", agent[2])
    return times


def _since(clock: str, moment: float) -> float:
    """Seconds from ``moment`` (``time.time()``) to the local clock time ``clock`` of the same
    day (torchrun logs the time of day, in local time)."""
    then = datetime.datetime.strptime(clock, "%H:%M:%S.%f").time()
    day = datetime.datetime.fromtimestamp(moment).date()
    return datetime.datetime.combine(day, then).timestamp() - moment


def elastic_run(scenario: str, workdir: Path, outage: float = 8.0,
                timeout: float = 300.0) -> dict:
    """One elastic run (``scenario`` is ``"kill"``, ``"cut"`` or ``"shrink"``: see the
    module): the agents' exit codes, the final weights' hash, what each node printed, and the
    seconds from the start to the fault, from the fault to node 0's "resumed" line and to the
    end."""
    if scenario not in _SCENARIOS:
        raise ValueError(f"scenario must be one of {_SCENARIOS}, got {scenario!r}")
    folder = workdir / f"elastic-{scenario}"

    def checkpoint_written() -> bool:
        manifest = checkpoint.latest_checkpoint(folder)
        return manifest is not None and manifest["step"] >= _FAULT_AFTER_STEP

    shrink = scenario == "shrink"
    args = [*COMMON, *(["--allow-resize"] if shrink else []), "--checkpoint-dir", str(folder)]
    result: dict = {"scenario": scenario, "nnodes": "1:2" if shrink else "2", "max_restarts": 3}
    with EmulatedCluster(2) as cluster:
        start = time.monotonic()
        agents = TorchrunAgents(
            "dpcourse.practice.train", cluster, args, module=True, nnodes=result["nnodes"],
            max_restarts=result["max_restarts"],
            # a fresh store per restart attempt on several nodes (chapter 8, pytorch#135712)
            # LOGLEVEL=INFO: the agents log when the workers failed and the rendezvous ended
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"},
            rdzv_conf=_RDZV_CONF,
        )
        try:
            agents.start()
            if scenario == "cut":
                fault = cluster.cut_link(1, when=checkpoint_written)

                def outage_over() -> bool:
                    return fault.applied_at is not None and time.monotonic() > (
                        fault.applied_at + outage)

                back = cluster.restore_link(1, when=outage_over)
            else:
                fault = cluster.kill_node(1, when=checkpoint_written)
            if not fault.wait(timeout):
                raise TimeoutError(f"the checkpoint of step {_FAULT_AFTER_STEP} was not written "
                                   f"within {timeout:g} s")
            fault_clock = time.time() - (time.monotonic() - fault.applied_at)  # as logs show
            if scenario == "kill":
                agents.start(1)  # a replacement on the spare machine
                result["replacement_started"] = time.monotonic() - fault.applied_at
            resumed = agents.wait_for("resumed from", 0, timeout)
            finished = agents.wait(timeout)
        finally:
            outputs = [agents.output(n) for n in range(2)]
            agents.close()
        end = time.monotonic()
    stages = {name: _since(clock, fault_clock) for name, clock in _agent_times(outputs[0]).items()}
    result.update(
        seconds_fault_to_workers_failed=stages.get("failed"),
        seconds_fault_to_rendezvous=stages.get("rendezvous"),
        returncodes=[a.returncode for a in finished],
        weights=(_WEIGHTS.findall(outputs[0]) or [None])[-1],
        world_at_end=int(re.findall(r"replicas identical on (\d+) rank", outputs[0])[-1])
        if "replicas identical" in outputs[0] else None,
        seconds_to_fault=fault.applied_at - start,
        seconds_fault_to_resumed=None if resumed is None else resumed - fault.applied_at,
        seconds_fault_to_end=end - fault.applied_at,
        fault=fault.describe(),
        output={f"node {n}": shown(text) for n, text in enumerate(outputs)},
    )
    if scenario == "cut":
        result["outage"] = back.applied_at - fault.applied_at
    return result


def run(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="dpcourse-elastic-"))
    result: dict = {"command": COMMON, "straight": straight_fingerprint(workdir)}
    for scenario in args.scenarios:
        result[scenario] = elastic_run(scenario, workdir, args.outage, args.timeout)
    return result


def report(result: dict) -> None:
    print(f"the run without a fault (2 ranks, one node) ends with weights {result['straight']}")
    for scenario in _SCENARIOS:
        r = result.get(scenario)
        if r is None:
            continue
        same = "the same weights" if r["weights"] == result["straight"] else "other weights"
        resumed = r["seconds_fault_to_resumed"]
        stages = ", ".join(f"{what} {r[key]:.1f} s" for what, key in (
            ("node 0's worker failed", "seconds_fault_to_workers_failed"),
            ("rendezvous complete", "seconds_fault_to_rendezvous"))
            if r.get(key) is not None)
        print(f"{scenario} (--nnodes={r['nnodes']}): {r['fault']}, {r['seconds_to_fault']:.1f} s "
              f"after the start; after the fault: {stages}, resumed "
              f"{'-' if resumed is None else f'{resumed:.1f}'} s, done "
              f"{r['seconds_fault_to_end']:.1f} s, on {r['world_at_end']} rank(s); agents "
              f"exited {r['returncodes']}, {same} ({r['weights']})")


def recovery_log(record: dict, scenario: str = "kill") -> list[str]:
    """The log chapter 8's exercise shows: what node 0 printed in the recorded ``scenario``
    (the lines :func:`shown` keeps), from :func:`run`'s result."""
    return list(record[scenario]["output"]["node 0"])


def resumed_step(lines: list[str]) -> int | None:
    """The step the job resumed from, as its "resumed from ... at step N" line says."""
    for line in lines:
        match = re.search(r"resumed from \S+ at step (\d+)", line)
        if match:
            return int(match.group(1))
    return None


def last_step_before_failure(lines: list[str]) -> int | None:
    """The last step logged before the job resumed (the work the checkpoint did not keep)."""
    last = None
    for line in lines:
        if "resumed from" in line:
            return last
        match = re.match(r"step\s+(\d+) \|", line)
        if match:
            last = int(match.group(1))
    return last
