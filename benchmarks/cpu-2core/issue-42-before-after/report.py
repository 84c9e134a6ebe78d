"""Before/after table of issue 42's benchmark runs: ours over torch's, per round and median."""
import json, glob, statistics, collections, os
import sys
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/w42b/ab"
def load(bench, tree):
    return [json.load(open(p)) for p in sorted(glob.glob(f"{OUT}/{bench}-{tree}-*.json"))]
def med(xs): return statistics.median(xs) if xs else float('nan')
for bench in ("allreduce", "ddp", "zero", "fsdp"):
    runs = {t: load(bench, t) for t in ("old", "new")}
    if not runs["old"] and not runs["new"]: continue
    print(f"== {bench}: rounds old {len(runs['old'])}, new {len(runs['new'])}")
    table = collections.defaultdict(dict)
    for tree, rs in runs.items():
        vals = collections.defaultdict(list)
        for r in rs:
            for row in r["rows"]:
                if bench == "allreduce":
                    size = row["bytes"]
                    for k in ("ring", "ring-step-by-step"):
                        vals[(f"{k} {size//1024} KiB", "median/lib")].append(row[f"{k}_over_library"])
                        vals[(f"{k} {size//1024} KiB", "p10/lib")].append(row[f"{k}_p10_over_library"])
                elif bench == "ddp":
                    vals[(f"{row['model']} {row['variant']}", "/torch DDP")].append(row["over_torch_ddp"])
                elif bench == "zero":
                    vals[(f"N={row['world_size']} {row['variant']}", "/ZeroRedundancyOptimizer")].append(row["over_zero_redundancy"])
                elif bench == "fsdp":
                    vals[(f"N={row['world_size']} {row['variant']}", "/fully_shard")].append(row["over_fully_shard"])
        for k, v in vals.items():
            table[k][tree] = (med(v), v)
    for (name, what), d in table.items():
        o = d.get("old", (float('nan'), [])); n = d.get("new", (float('nan'), []))
        print(f"  {name:<40} {what:<26} old {o[0]:.3f} {[round(x,3) for x in o[1]]}  new {n[0]:.3f} {[round(x,3) for x in n[1]]}")
