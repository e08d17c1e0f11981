"""How long the kernel lets one CPU-bound process run before another on the same core gets its turn.

Run two copies pinned to one core: ``taskset -c 1 python3 devtools/cpu_slice.py A & taskset -c 1 python3
devtools/cpu_slice.py B; wait``. Each spins for ``SECONDS`` and prints the median and the 10th/90th percentile
of the gaps (> 0.1 ms) in which it did not run: the other one's time slices.
"""

from __future__ import annotations

import sys

from hpczeco.drivers.mpienv import spin_gaps

SECONDS = 3.0


def main() -> None:
    g = sorted(spin_gaps(SECONDS, 1e-4))
    tag = sys.argv[1] if len(sys.argv) > 1 else ""
    if not g:
        print(f"{tag} no gaps above 0.1 ms (the core was not shared)")
        return
    n = len(g)
    med, p10, p90 = g[n // 2] * 1e3, g[n // 10] * 1e3, g[9 * n // 10] * 1e3
    print(f"{tag} {n} gaps: median {med:.2f} ms, p10 {p10:.2f}, p90 {p90:.2f}")


if __name__ == "__main__":
    main()
