"""Re-model the recorded P=12 ring runs of the H200 host with the ring stage term and eager = 4 KiB (offline; run
from the repository root: `python devtools/ring_refit.py`; docs/benchmarks/network.md section 5)."""
import json
import sys

sys.path.insert(0, ".")
from collectives import costmodel as cm  # noqa: E402

RING_2MIB = {8: 4.415e-3, 16: 5.471e-3, 48: 4.559e-3}  # call 8, shift_table.py (measure_ring's method)
for f in ("call8/scanring", "call1/scancal"):
    d = json.load(open(f"docs/benchmarks/device-2026-12-02/{f}/scan_P12.json"))
    p = cm.LinkParams(**{**d["params"], "piece": 0.0, "eager": 4096.0})
    pc, rb = cm.ring_from_times(12, 2 << 20, list(RING_2MIB), list(RING_2MIB.values()), p)
    q = cm.replace(p, piece=pc, ring_beta=rb)
    print(f, q.describe())
    for r in d["results"]:
        if r["topology"] == "ring" and r["nbytes"] >= 1 << 20:
            k, m = r["blocks"], r["nbytes"]
            print(f"  {r['label']:>10} {m >> 20} MiB k={k:>3}: measured {r['median_s'] * 1e3:7.3f} ms, before "
                  f"{r['model_s'] * 1e3:6.3f} ({r['median_s'] / r['model_s']:.2f}x), with the terms "
                  f"{cm.ring_time(12, m, k, q) * 1e3:6.3f} ms ({r['median_s'] / cm.ring_time(12, m, k, q):.2f}x)")
    print("  the model's k now:", {m >> 20: cm.best_blocks(12, m, 128, q) for m in (1 << 20, 4 << 20)})
