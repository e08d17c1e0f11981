"""Measure ``hpczeco prefill``'s peak memory against its own estimate (docs/RELIABILITY.md).

Usage: python prefill_memory.py FILE [prefill options...]
Runs the driver in this process with ``--json`` and prints one JSON line (per rank under mpiexec; the
estimate, the largest rank's, on rank 0): the estimate's bytes per rank,
the resident set before the prefill started (after the imports), the peak resident set (``ru_maxrss``)
and the peak's growth over that baseline.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import sys


def _rss_kb() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main() -> None:
    from hpczeco.drivers.prefill import main as prefill  # noqa: PLC0415

    base = _rss_kb()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = prefill([*sys.argv[1:], "--json"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rec = json.loads(out.getvalue()) if rc == 0 and out.getvalue().strip() else {}  # rank 0 prints the JSON
    est = rec.get("estimate", {})
    print(json.dumps({"rc": rc, "tokens": rec.get("tokens"), "global_fraction": est.get("global_fraction"),
                      "estimate_mib": est.get("bytes_per_rank", 0) / 2**20, "baseline_mib": base / 1024,
                      "peak_mib": peak / 1024, "growth_mib": (peak - base) / 1024}))


if __name__ == "__main__":
    main()
