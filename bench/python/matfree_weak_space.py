"""Why the matfree method does not converge where N > rank(X) (docs/MATH.md §12, "Why it breaks
there"): the bottom of J J^T's spectrum, what the channel blocks do to it, and which coarse levels
help. NumPy and SciPy on the dense G = J J^T of bench/python/matfree_regime.py's instance (seed
2025, LayerNorm'd tokens, causal mask, W ~ N(0, scale^2), c = 1/sqrt(d)); N d_v up to about 8192.

    python bench/python/matfree_weak_space.py --N 256 --D 192 --d 32 --k 16 65 81 113 161
    python bench/python/matfree_weak_space.py --N 160 --D 96 --d 16 --k 81 --cheap

Printed: kappa(J), how many eigenvalues of G lie within 2x and 10x of the smallest, and the same
for M^-1 G; S = (P X)(P X)^T's smallest range eigenvalues over lambda_min(G); then for each k the
additive two-level preconditioner M^-1 = blocks^-1 + Z E^-1 Z^T (Z = I ⊗ U_k, U_k the k smallest
eigenvectors of S, E = Z^T G Z exact), its kappa(M^-1 G) and SciPy's LOBPCG iterations (block 1,
relative residual 1e-7). With --cheap, for the last k, cheaper forms of E in its place: its
d_v x d_v blocks for each mode alone, and its nearest Kronecker product (channel x token).
"""
import argparse
import time

import numpy as np
import scipy.linalg as sl
from scipy.sparse.linalg import lobpcg

from matfree_regime import compress, gram_parts, instance


def channel_blocks_inverse(G, N, d):
    """The d_v diagonal N x N blocks of G (rows a N + i), inverted: the method's R = I blocks."""
    Mi = np.zeros_like(G)
    for a in range(d):
        s = slice(a * N, (a + 1) * N)
        Mi[s, s] = np.linalg.inv(G[s, s])
    return Mi


def report(G, lam, Minv, name):
    C = np.linalg.cholesky((Minv + Minv.T) / 2)
    ev = np.linalg.eigvalsh(C.T @ G @ C)
    x0 = np.random.default_rng(1).standard_normal((G.shape[0], 1))
    tol = 1e-7 * np.sqrt(lam[-1] * lam[0])
    w, _, hist = lobpcg(G, x0, M=Minv, largest=False, tol=tol, maxiter=6000,
                        retResidualNormsHistory=True)
    print(f"{name:34s} kappa(M^-1 G) {ev[-1] / ev[0]:.2e}, within 2x/10x of the smallest "
          f"{(ev < 2 * ev[0]).sum()}/{(ev < 10 * ev[0]).sum()}, LOBPCG {len(hist)} iterations "
          f"(lambda_min off by {abs(w[0] / lam[0] - 1):.0e})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--N', type=int, default=256)
    ap.add_argument('--D', type=int, default=192)
    ap.add_argument('--d', type=int, default=32)
    ap.add_argument('--scale', type=float, default=0.02)
    ap.add_argument('--k', type=int, nargs='*', default=[16])
    ap.add_argument('--cheap', action='store_true')
    a = ap.parse_args()
    N, d = a.N, a.d
    X, W = instance(N, a.D, d, scale=a.scale)
    L, Wc = compress(X, W)
    GQK, S, _, _ = gram_parts(L, *Wc, 1 / np.sqrt(d))
    G = GQK + np.kron(np.eye(d), S)
    t = time.time()
    lam = np.linalg.eigvalsh(G)
    mu, Us = np.linalg.eigh(S)
    m = N - np.linalg.matrix_rank(X)
    print(f"N = {N}, D = {a.D}, d = {d}: {m} null modes of S, kappa(J) = "
          f"{np.sqrt(lam[-1] / lam[0]):.3e} ({time.time() - t:.0f} s for the spectrum)")
    print(f"G: within 2x/10x of the smallest {(lam < 2 * lam[0]).sum()}/{(lam < 10 * lam[0]).sum()}"
          f" of {G.shape[0]}")
    print("S's smallest range eigenvalues over lambda_min(G):",
          np.array2string(mu[m:m + 24] / lam[0], precision=2, max_line_width=200))
    M1 = channel_blocks_inverse(G, N, d)
    report(G, lam, M1, "channel blocks")
    for k in a.k:
        Z = np.kron(np.eye(d), Us[:, :k])
        E = Z.T @ G @ Z
        report(G, lam, M1 + Z @ np.linalg.inv(E) @ Z.T, f"+ coarse level, exact E, k = {k}")
    if not a.cheap or not a.k:
        return
    idx = np.arange(d * k).reshape(d, k)  # E's rows a k + j: channel a, mode j
    Em = np.zeros_like(E)
    for j in range(k):
        Em[np.ix_(idx[:, j], idx[:, j])] = E[np.ix_(idx[:, j], idx[:, j])]
    report(G, lam, M1 + Z @ np.linalg.inv(Em) @ Z.T, f"+ E's per-mode blocks, k = {k}")
    R = E.reshape(d, k, d, k).transpose(0, 2, 1, 3).reshape(d * d, k * k)
    u, s, vt = sl.svd(R, full_matrices=False)
    print("E rearranged (Van Loan-Pitsianis): relative singular values",
          np.array2string(s[:6] / s[0], precision=3))
    A, B = u[:, 0].reshape(d, d), vt[0].reshape(k, k)
    if np.trace(A) < 0:
        A, B = -A, -B
    Ek = s[0] * np.kron((A + A.T) / 2, (B + B.T) / 2)
    if np.linalg.eigvalsh(Ek)[0] > 0:
        report(G, lam, M1 + Z @ np.linalg.inv(Ek) @ Z.T, f"+ E's nearest Kronecker product")
    else:
        print("E's nearest Kronecker product is not positive definite")


if __name__ == '__main__':
    main()
