#!/usr/bin/env python3
"""Round two against a rerun with other seeds (docs/reproduction.md, "Round two"): every claim of
significance of the committed run (Holm-corrected p < 0.05, final metric or learning curve)
checked for its direction on the rerun's seeds.

  .venv-py/bin/python experiments/round2.py --first-seed 10 --seeds 3 --out OTHER [--tasks ...]
  .venv-py/bin/python experiments/rerun_check.py docs/reproduction/round2 OTHER/runs

Writes epochs-other-seeds.csv (the rerun's rows, from its kept runs) and rerun-other-seeds.md
(the table) into the first folder.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
import round2  # noqa: E402
import stats2  # noqa: E402
from train import ARMS2  # noqa: E402


def read_rows(path):
    """epochs.csv as written by round2.py, its cells back to numbers."""
    import csv

    def cell(v):
        if v == "":
            return math.nan
        if v in ("true", "false"):
            return v == "true"
        try:
            return float(v)
        except ValueError:
            return v

    with open(path, newline="") as f:
        return [{k: cell(v) for k, v in r.items()} for r in csv.DictReader(f)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="the committed run's folder (epochs.csv)")
    p.add_argument("runs", help="the rerun's kept runs (OTHER/runs)")
    a = p.parse_args(argv)
    other = []
    for f in sorted(glob.glob(os.path.join(a.runs, "main_*.json"))):
        other += round2._load(f)["rows"]
    if not other:
        p.error(f"runs: no main_*.json in {a.runs}")
    report.write_csv(os.path.join(a.folder, "epochs-other-seeds.csv"), other,
                     round2.EPOCH_COLUMNS)
    other = read_rows(os.path.join(a.folder, "epochs-other-seeds.csv"))
    rows = read_rows(os.path.join(a.folder, "epochs.csv"))
    text = stats2.direction_check(rows, other, list(ARMS2))
    report.write_atomic(os.path.join(a.folder, "rerun-other-seeds.md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
