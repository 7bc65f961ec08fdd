#!/usr/bin/env python3
"""Peer for the matfree method (docs/MATH.md §12): PRIMME's svds for the extreme singular values
of the same J, given as a dense matrix (its products are then one BLAS GEMV each, cheaper than
the JVP and VJP the matfree method uses).

    .venv-peers/bin/python bench/peers/primme_svds.py J.npy REPORT.json

REPORT.json is `spectral-cond kappa --format json` on the same instance. PRIMME is asked for
sigma_min with a residual tolerance tol ||J|| chosen so that its error bound, tol kappa, equals
the stated accuracy of the report (no smaller than 4 eps); sigma_max with tol 1e-14. Prints
PRIMME's time, products and relative difference to the report, one line, and the thread count
of numpy's BLAS.
"""
import json
import os
import sys
import time

from importlib.metadata import version

import numpy as np
import primme


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    J = np.load(sys.argv[1])
    rep = json.load(open(sys.argv[2]))
    kappa, acc = float(rep["kappa"]), float(rep["accuracy"])
    tol = max(acc / kappa, 4 * np.finfo(float).eps)
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    t0 = time.perf_counter()
    _, smax, _, st_max = primme.svds(J, 1, which="LM", tol=1e-14, return_stats=True)
    _, smin, _, st_min = primme.svds(J, 1, which="SM", tol=tol, return_stats=True, maxMatvecs=2_000_000)
    seconds = time.perf_counter() - t0
    products = int(st_max["numMatvecs"]) + int(st_min["numMatvecs"])
    rel = abs(smin[0] - float(rep["sigma_min"])) / float(rep["sigma_min"])
    print(f"primme {version('primme')} svds of J {J.shape[0]} x {J.shape[1]} (BLAS threads: "
          f"{threads}): {seconds:.2f} s, {products} products, sigma_min {smin[0]:.15e}, "
          f"kappa {smax[0] / smin[0]:.6e}, rel. difference to the report {rel:.2e} "
          f"(tol {tol:.1e}, the report's stated accuracy {acc:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
