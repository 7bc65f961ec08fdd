#!/usr/bin/env python3
"""Plots the output of scripts/bench-matfree: wall time and peak memory of the matfree method
against the context length N, on log-log axes, with the issue's goals marked.

    scripts/bench-matfree 128 256 512 1024 2048 | tee matfree.txt
    python bench/python/plot_matfree.py matfree.txt docs/matfree_scaling.png

Needs matplotlib. Lines without a report ("no report") are skipped; runs that declined (info
other than success) are drawn as crosses, apart from the answered ones.
"""
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def seconds(wall: str) -> float:
    s = 0.0
    for part in wall.split(":"):
        s = 60 * s + float(part)
    return s


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    rows = []
    pat = re.compile(r"N\s+(\d+): wall ([0-9:.]+), peak RSS ([0-9.]+) GiB, info (\w+)")
    for line in open(sys.argv[1]):
        m = pat.search(line)
        if m:
            rows.append((int(m.group(1)), seconds(m.group(2)), float(m.group(3)), m.group(4)))
    if not rows:
        print(f"plot_matfree: no result lines in {sys.argv[1]}", file=sys.stderr)
        return 1
    ok = [r for r in rows if r[3] == "success"]
    bad = [r for r in rows if r[3] != "success"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, col in ((a, 1), (b, 2)):
        ax.loglog([r[0] for r in ok], [r[col] for r in ok], "o-", base=2, label="answered")
        if bad:
            ax.scatter([r[0] for r in bad], [r[col] for r in bad], marker="x", color="black",
                       label="declined (not converged)")
    a.scatter([1024, 2048], [120, 600], marker="_", s=300, color="red", label="goal")
    a.set_xlabel("context length N")
    a.set_ylabel("wall time (s)")
    a.legend()
    b.scatter([1024, 2048], [4, 8], marker="_", s=300, color="red", label="goal")
    b.set_xlabel("context length N")
    b.set_ylabel("peak RSS (GiB)")
    b.legend()
    fig.suptitle("kappa(J) of a GPT-2-small head by matfree (D = 768, d = 64, causal)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
