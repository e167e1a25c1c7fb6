"""Pairs the probe files of a folder (scripts/gpu_host_prepare_probe.py: host-prepare-ff569b6-N.json and
host-prepare-new-N.json, one process each, run alternately on one host) into its summary.json.

    python3 scripts/host_prepare_pairs.py runs/serve-host-overhead-tp8-b1
"""
import glob
import json
import os
import statistics
import sys

d = sys.argv[1]
pairs = []
for old in sorted(glob.glob(os.path.join(d, "host-prepare-ff569b6-*.json"))):
    new = old.replace("ff569b6", "new")
    o, n = (json.load(open(f))["median_ms"]["graph draw"] for f in (old, new))
    pairs.append({"run": old.rsplit("-", 1)[1][:-5], "ff569b6": o, "new": n,
                  "engine_step_saved_ms": o["engine_step"] - n["engine_step"]})
saved = [p["engine_step_saved_ms"] for p in pairs]
out = {"pairs": pairs, "median_engine_step_saved_ms": statistics.median(saved),
       "median_engine_step_ms": {k: statistics.median(p[k]["engine_step"] for p in pairs) for k in ("ff569b6", "new")},
       "median_device_ms": {k: statistics.median(p[k]["device"] for p in pairs) for k in ("ff569b6", "new")},
       "median_prepare_ms": {k: statistics.median(p[k]["prepare"] for p in pairs) for k in ("ff569b6", "new")}}
json.dump(out, open(os.path.join(d, "summary.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in out.items() if k != "pairs"}, indent=1), [round(s, 3) for s in saved])
