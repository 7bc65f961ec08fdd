"""What biases and RoPE cost each kappa(J) method (MATH.md §10): the time of one call with them
over the time of the same call without, measured in one run, on the same data, with the
thread count printed. Biases change only the forward cache; RoPE makes each J_K column two
softmax products, J_K J_K^T unstructured (gram) and the query-key reduction of qr unavailable.

    OPENBLAS_NUM_THREADS=1 python bench/python/bench_bias_rope.py [--size 48] [--repeats 3]
"""

import argparse
import os
import sys

import numpy as np

import spectral_cond as sc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_binding import best_of  # noqa: E402  (one timing helper for the Python benchmarks)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=48, help="N = D = d_k = d_v")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    n = a.size
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, n))
    WQ, WK, WV = (rng.standard_normal((n, n)) / np.sqrt(n) for _ in range(3))
    b = tuple(rng.standard_normal(n) * 0.1 for _ in range(3))
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(f"N = D = d_k = d_v = {n}, OPENBLAS_NUM_THREADS={threads}, best of {a.repeats}")
    print(f"{'method':8} {'plain s':>9} {'biases':>8} {'rope':>8} {'both':>8}   (ratios to plain)")
    for method in ("gram", "qr"):
        def run(**kw):
            return best_of(lambda: sc.kappa_jacobian(X, WQ, WK, WV, method=method, threads=1,
                                                     **kw), a.repeats)
        t0 = run()
        tb = run(biases=b)
        tr = run(rope="rotate_half")
        tbr = run(biases=b, rope="rotate_half")
        print(f"{method:8} {t0:9.3f} {tb / t0:8.2f} {tr / t0:8.2f} {tbr / t0:8.2f}")


if __name__ == "__main__":
    main()
