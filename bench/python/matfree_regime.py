"""What the Gram matrix G = J J^T of a GPT-2-small-shaped head looks like where the matfree method
does not converge (docs/MATH.md §12, "Open"). NumPy only, on the dense G of the compressed
Jacobian (§3: G = c^2 [(1 1^T ⊗ L L^T) ∘ (B B^T) + (1 1^T ⊗ Q Q^T) ∘ (E E^T)] + I ⊗ S), so it
fits for N d_v up to about 8192 (N = 128, d = 64: about 3 minutes and 2 GiB on 2 cores).

    python bench/python/matfree_regime.py [--N 64] [--D 768] [--d 64] [--scale 0.02] [--kron]

The instance is scripts/bench-matfree's (seed 2025, LayerNorm'd tokens, causal mask,
W ~ N(0, scale^2), c = 1/sqrt(d)). Printed: sigma_max, sigma_min and kappa of J from G; sigma_N(P X)
(the proven lower bound of §5); how much of each of the smallest eigenvectors, read as an
N x d_v matrix, lies in its best rank-1 approximation and on the smallest eigenvectors of S;
the Rayleigh-Ritz value on span(s_1..s_k) ⊗ R^{d_v}; kappa(M^{-1} G) for the d_v channel blocks
and for the d_v x d_v blocks in the eigenbasis of S (with --kron also I ⊗ S plus the nearest
Kronecker product of G - I ⊗ S, slow); and the floor of the residual bound eta for the rounded
smallest eigenvector. A closed-form G is checked against central differences first.
"""
import argparse

import numpy as np
import scipy.linalg as sl


def instance(N, D, d, seed=2025, scale=0.02):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    X = (X - X.mean(1, keepdims=True)) / X.std(1, keepdims=True)
    return X, [scale * rng.standard_normal((D, d)) for _ in range(3)]


def softmax_causal(Z):
    Z = Z + np.triu(np.full(Z.shape, -np.inf), 1)
    E = np.exp(Z - Z.max(1, keepdims=True))
    return E / E.sum(1, keepdims=True)


def compress(X, W):
    """X = L V^T (thin SVD) and V^T W: the same J J^T (§3), products of size N in place of D."""
    if X.shape[0] >= X.shape[1]:
        return X, W
    U, s, Vt = np.linalg.svd(X, full_matrices=False)
    return U * s, [Vt @ w for w in W]


def gram_parts(X, WQ, WK, WV, c):
    """G_QK = J_QK J_QK^T and S = (P X)(P X)^T, rows ordered a N + i (column-major vec)."""
    Q, K, V = X @ WQ, X @ WK, X @ WV
    P = softmax_causal(c * Q @ K.T)
    N, dv = V.shape
    PV = P @ V
    # Per token i: V^T Λ(p_i) K (d_v x d_k) and V^T Λ(p_i) X (d_v x D).
    Bt = np.einsum('ij,ja,jb->iab', P, V, K) - np.einsum('ia,ib->iab', PV, P @ K)
    Et = np.einsum('ij,ja,jb->iab', P, V, X) - np.einsum('ia,ib->iab', PV, P @ X)
    B = Bt.transpose(1, 0, 2).reshape(N * dv, -1)
    E = Et.transpose(1, 0, 2).reshape(N * dv, -1)
    ones = np.ones((dv, dv))
    GQK = c * c * (np.kron(ones, X @ X.T) * (B @ B.T) + np.kron(ones, Q @ Q.T) * (E @ E.T))
    PX = P @ X
    return GQK, PX @ PX.T, PX, V


def check_against_differences():
    X, W = instance(5, 7, 3, scale=0.5)
    c = 1 / np.sqrt(3)

    def out(Ws):
        Q, K, V = (X @ w for w in Ws)
        return (softmax_causal(c * Q @ K.T) @ V).flatten('F')

    cols, h = [], 1e-6
    for k in range(3):
        for col in range(3):
            for row in range(7):
                Wp = [w.copy() for w in W]
                Wm = [w.copy() for w in W]
                Wp[k][row, col] += h
                Wm[k][row, col] -= h
                cols.append((out(Wp) - out(Wm)) / (2 * h))
    J = np.array(cols).T
    L, Wc = compress(X, W)
    GQK, S, _, _ = gram_parts(L, *Wc, c)
    G = GQK + np.kron(np.eye(3), S)
    err = np.abs(J @ J.T - G).max() / np.abs(G).max()
    assert err < 1e-8, f"closed-form G differs from central differences by {err:.1e}"


def kappa_pencil(G, M):
    ev = sl.eigh(G, M, eigvals_only=True)
    return ev[-1] / ev[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--N', type=int, default=64)
    ap.add_argument('--D', type=int, default=768)
    ap.add_argument('--d', type=int, default=64)
    ap.add_argument('--scale', type=float, default=0.02)
    ap.add_argument('--kron', action='store_true')
    a = ap.parse_args()
    check_against_differences()
    N, d = a.N, a.d
    X, W = instance(N, a.D, d, scale=a.scale)
    c = 1 / np.sqrt(d)
    L, Wc = compress(X, W)
    GQK, S, PX, V = gram_parts(L, *Wc, c)
    G = GQK + np.kron(np.eye(d), S)
    lam, U = np.linalg.eigh(G)
    sig = np.sqrt(np.maximum(lam, 0))
    mu, Us = np.linalg.eigh(S)
    sN = np.linalg.svd(PX, compute_uv=False)[-1]
    print(f"N = {N}, D = {a.D}, d = {d}, W ~ N(0, {a.scale}^2), causal, LayerNorm'd tokens")
    print(f"sigma_max(J) {sig[-1]:.6e}  sigma_min(J) {sig[0]:.6e}  kappa {sig[-1] / sig[0]:.4e}"
          f" (from G: relative error about eps kappa^2 = {2.2e-16 * (sig[-1] / sig[0])**2:.0e})")
    print(f"sigma_N(P X) {sN:.6e} (proven lower bound on sigma_min, MATH.md 5)")
    print(f"smallest sigma(J): {np.array2string(sig[:6], precision=4)}")
    for k in range(3):
        M = U[:, k].reshape(d, N)
        rank1 = np.linalg.svd(M, compute_uv=False)[0] ** 2
        on_modes = np.cumsum(((M @ Us) ** 2).sum(0))
        print(f"eigenvector {k}: rank-1 energy {rank1:.4f}; on the 1, 2, 4, 8 smallest modes of S: "
              + ", ".join(f"{on_modes[j - 1]:.4f}" for j in (1, 2, 4, 8)))
    for k in (1, 2, 4):
        Z = np.kron(np.eye(d), Us[:, :k])
        print(f"Rayleigh-Ritz on span(s_1..s_{k}) x R^d_v: sigma {np.sqrt(np.linalg.eigvalsh(Z.T @ G @ Z)[0]):.4e}")
    Mc = np.zeros_like(G)
    for a_ in range(d):
        s = slice(a_ * N, (a_ + 1) * N)
        Mc[s, s] = G[s, s]
    print(f"kappa(M^-1 G), d_v channel blocks: {kappa_pencil(G, Mc):.3e}")
    T = np.kron(np.eye(d), Us)
    Gh = T.T @ G @ T
    Mm = np.zeros_like(G)
    for j in range(N):
        idx = np.arange(d) * N + j
        Mm[np.ix_(idx, idx)] = Gh[np.ix_(idx, idx)]
    print(f"kappa(M^-1 G), d_v x d_v blocks in the eigenbasis of S: {kappa_pencil(Gh, Mm):.3e}")
    if a.kron:
        R = GQK.reshape(d, N, d, N).transpose(0, 2, 1, 3).reshape(d * d, N * N)
        u, s, vt = sl.svd(R, full_matrices=False)
        Bk = (u[:, 0] * np.sqrt(s[0])).reshape(d, d)
        Ak = (vt[0] * np.sqrt(s[0])).reshape(N, N)
        if np.trace(Bk) < 0:
            Bk, Ak = -Bk, -Ak
        Bk, Ak = (Bk + Bk.T) / 2, (Ak + Ak.T) / 2
        Bk += 1e-12 * np.trace(Bk) * np.eye(d)
        Mk = np.kron(np.eye(d), S) + np.kron(Bk, Ak)
        print(f"kappa(M^-1 G), I x S + nearest Kronecker product of G_QK: {kappa_pencil(G, Mk):.3e}")
    # The floor of eta = ||G x - theta x|| / theta for x rounded to double (|delta_i| = eps |x_i| / 2).
    x = U[:, 0]
    floor = 0.5 * 2.2e-16 * np.sqrt((x ** 2 * (G * G).sum(1)).sum()) / lam[0]
    print(f"floor of eta for the rounded smallest eigenvector: {floor:.1e} "
          f"(eps kappa {2.2e-16 * sig[-1] / sig[0]:.1e})")


if __name__ == '__main__':
    main()
