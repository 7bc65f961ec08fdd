#!/usr/bin/env python3
"""Peer for bench_qr_kappa (MATH.md §3): numpy's LAPACK SVD (gesdd) of the same J.

    build/bench/bench_qr_kappa --write-npy DIR      # writes X, W_Q, W_K, W_V, J, the results
    .venv/bin/python bench/peers/numpy_svd.py DIR

Prints numpy's time, the time ratios numpy / qr and numpy / lobpcg (their times as measured by
the bench in its own run) and the agreement of sigma_min and kappa. numpy's BLAS may use several
threads; the thread count is printed beside the ratio.
"""
import os
import sys
import time

import numpy as np


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    d = sys.argv[1]
    J = np.load(os.path.join(d, "J.npy"))
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or "default"
    t0 = time.perf_counter()
    s = np.linalg.svd(J, compute_uv=False)
    seconds = time.perf_counter() - t0
    k = s[0] / s[-1]
    print(f"numpy {np.__version__} svd of J {J.shape[0]} x {J.shape[1]}: {seconds:.3f} s "
          f"(BLAS threads: {threads})")
    print(f"  sigma_max {s[0]:.15e}  sigma_min {s[-1]:.15e}  kappa {k:.10e}")
    for method in ("qr", "lobpcg"):
        path = os.path.join(d, f"{method}_result.npy")
        if not os.path.exists(path):
            continue
        _, sigma_min, kappa, method_seconds = np.load(path).ravel()
        print(f"  {method} (bench, same data): sigma_min {sigma_min:.15e}  kappa {kappa:.10e}  "
              f"{method_seconds:.3f} s")
        print(f"  time ratio numpy / {method} = {seconds / method_seconds:.1f}x; sigma_min rel. "
              f"diff {abs(s[-1] - sigma_min) / s[-1]:.2e}, kappa rel. diff {abs(k - kappa) / k:.2e} "
              f"(eps kappa = {np.finfo(float).eps * k:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
