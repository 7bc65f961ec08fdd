"""The Python binding's overhead on one kappa_jacobian call against the same call from C++
(kappa_jacobian_timing, built from this checkout with the same flags and thread count), and
whether float64 Fortran-order input is read without a copy.

    python bench/python/bench_binding.py --exe build-py/python/kappa_jacobian_timing [--threads 2]
        [--vit-b]

Run with OPENBLAS_NUM_THREADS set to the same count (the C++ program inherits it).
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

import numpy as np

import spectral_cond as sc


def best_of(f, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vit-b", action="store_true",
                    help="also one ViT-B head (N = 197, D = 768, d = 64, method auto; tens of "
                         "seconds per call, so timed once on each side)")
    a = ap.parse_args()
    rng = np.random.default_rng(20251201)
    cases = [((8, 8, 4, 4), "dense"), ((16, 16, 8, 8), "dense"), ((32, 32, 32, 32), "qr")]
    if a.vit_b:
        cases.append(((197, 768, 64, 64), "auto"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (N, D, dk, dv), method in cases:
            vit = N * dv > 4096
            repeats = 1 if vit else a.repeats
            X = np.asfortranarray(rng.standard_normal((N, D)))
            W = [np.asfortranarray(0.5 * rng.standard_normal((D, d))) for d in (dk, dk, dv)]
            if vit:  # LayerNorm-like tokens and default-initialisation scale, as a ViT's
                X = (X - X.mean(1, keepdims=True)) / X.std(1, keepdims=True)
                W = [np.asfortranarray(w * 0.04) for w in W]
            paths = []
            for name, M in zip(("X", "WQ", "WK", "WV"), [X] + W):
                p = os.path.join(tmp, name + ".npy")
                np.save(p, M)
                paths.append(p)
            out = subprocess.run([a.exe, *paths, method, str(a.threads), str(repeats)],
                                 check=True, capture_output=True, text=True).stdout
            cpp = json.loads(out.replace("inf", "Infinity"))  # printf writes +inf as inf
            py_res = sc.kappa_jacobian(X, *W, method=method, threads=a.threads)
            py = best_of(lambda: sc.kappa_jacobian(X, *W, method=method, threads=a.threads),
                         repeats)
            assert py_res.kappa == cpp["kappa"], (py_res.kappa, cpp["kappa"])
            rows.append(((N, D, dk, dv), method, cpp["seconds"], py, py / cpp["seconds"],
                         (py - cpp["seconds"]) * 1e6))
    print("kappa_jacobian, best of %d, %d threads" % (a.repeats, a.threads))
    print(f"{'(N, D, d_k, d_v)':>18} {'method':>7} {'C++ s':>10} {'Python s':>10} "
          f"{'ratio':>7} {'extra us':>9}")
    for shape, m, c, p, r, us in rows:
        print(f"{str(shape):>18} {m:>7} {c:10.6f} {p:10.6f} {r:7.3f} {us:9.1f}")

    # Zero copy: the binding's view of a float64 Fortran-order array is the array's memory.
    # A wide X (N small, so the N x N softmax is cheap) makes the copy of a C-order X visible.
    F = np.asfortranarray(rng.standard_normal((256, 65536)))
    C = np.ascontiguousarray(F)
    w = [np.asfortranarray(rng.standard_normal((65536, 1))) for _ in range(3)]
    print("input_is_borrowed: float64 F", sc._core.input_is_borrowed(F),
          "| float64 C", sc._core.input_is_borrowed(C),
          "| float32 F", sc._core.input_is_borrowed(np.asfortranarray(F, dtype=np.float32)))
    tf = best_of(lambda: sc.attention(F, *w), a.repeats)
    tc = best_of(lambda: sc.attention(C, *w), a.repeats)
    tcopy = best_of(lambda: np.asfortranarray(C), a.repeats)
    print(f"attention with X 256 x 65536 float64 (128 MiB): Fortran order {tf * 1e3:.1f} ms, "
          f"C order {tc * 1e3:.1f} ms (difference {1e3 * (tc - tf):.1f} ms; one numpy copy of X "
          f"to Fortran order takes {tcopy * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
