"""Every function of the spectral_cond package against an independent reference: numpy's SVD and
a numpy attention, torch.func.jacrev for J, J itself for the JVP, VJP and Gram matrix."""

import math

import numpy as np
import pytest

import spectral_cond as sc
from conftest import EPS, instance, np_attention, torch_jacobian


def rel(a, b):
    return np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-300)


# --- condition numbers (MATH.md §4) -------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 4), (4, 7), (5, 5)])
@pytest.mark.parametrize("order", ["C", "F"])
def test_kappa_against_numpy_svd(rng, shape, order):
    M = np.array(rng.standard_normal(shape), order=order)
    s = np.linalg.svd(M, compute_uv=False)
    r = sc.kappa(M)
    assert isinstance(r, sc.ConditionResult)
    assert abs(r.sigma_max - s[0]) <= 50 * EPS * s[0]
    assert abs(r.sigma_min - s[-1]) <= 50 * EPS * s[0]
    assert abs(r.kappa - s[0] / s[-1]) <= 100 * EPS * r.kappa * (s[0] / s[-1])
    assert r.rank == min(shape) and r.info == "success"
    assert r.kappa_plus == pytest.approx(r.kappa, rel=1e-14)
    assert abs(r.accuracy - EPS * r.kappa) <= 1e-12 * r.accuracy
    np.testing.assert_allclose(sc.singular_values(M), s, rtol=0, atol=50 * EPS * s[0])
    assert sc.kappa_plus(M).to_dict() == r.to_dict()


def test_kappa_singular_is_inf_never_huge(rng):
    A = rng.standard_normal((6, 3))
    M = A @ rng.standard_normal((3, 5))  # rank 3, 6 x 5
    s = np.linalg.svd(M, compute_uv=False)
    r = sc.kappa(M)
    assert r.kappa == float("inf") and math.isinf(r.to_dict()["kappa"])
    assert r.info == "singular" and r.rank == 3
    assert r.kappa_plus == pytest.approx(s[0] / s[2], rel=1e-12)
    assert "inf" in repr(r)
    z = sc.kappa(np.zeros((3, 2)))
    assert z.rank == 0 and math.isinf(z.kappa) and math.isnan(z.kappa_plus)


def test_kappa_float32_uses_float32_tolerance(rng):
    M = rng.standard_normal((6, 4))
    r32 = sc.kappa(M.astype(np.float32))
    s = np.linalg.svd(M.astype(np.float32).astype(np.float64), compute_uv=False)
    assert r32.kappa == pytest.approx(s[0] / s[-1], rel=1e-4)
    assert r32.rank_tol == pytest.approx(6 * np.finfo(np.float32).eps * r32.sigma_max, rel=1e-5)
    assert sc.singular_values(M.astype(np.float32)).dtype == np.float32


def test_kappa_rtol_and_svd_choice(rng):
    M = np.diag([1.0, 1e-3, 1e-9])
    assert sc.kappa(M).rank == 3
    r = sc.kappa(M, rtol=1e-6)
    assert r.rank == 2 and math.isinf(r.kappa) and r.kappa_plus == pytest.approx(1e3)
    for svd in ("jacobi", "bdc", "lapack", "auto"):
        assert sc.kappa(M, svd=svd).kappa == pytest.approx(1e9, rel=1e-6)


# --- attention, JVP, VJP (MATH.md §1–2) ---------------------------------------------------

@pytest.mark.parametrize("mask", [None, "causal", "additive"])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_attention_against_numpy(rng, mask, scale):
    X, WQ, WK, WV = instance(rng, N=6, D=5, dk=3, dv=4)
    m = mask
    if mask == "additive":
        m = rng.standard_normal((6, 6))
        m[0, 1:] = -np.inf
    A = sc.attention(X, WQ, WK, WV, scale=scale, mask=m)
    ref = np_attention(X, WQ, WK, WV, scale=scale, mask=m)
    assert A.shape == (6, 4) and A.dtype == np.float64
    assert rel(A, ref) <= 100 * EPS


def test_attention_float32_stays_float32(rng):
    X, WQ, WK, WV = instance(rng, dtype=np.float32, order="C")
    A = sc.attention(X, WQ, WK, WV)
    assert A.dtype == np.float32
    ref = np_attention(*(a.astype(np.float64) for a in (X, WQ, WK, WV)))
    assert rel(A, ref) <= 1e-5


def test_jvp_and_vjp_against_J(rng):
    X, WQ, WK, WV = instance(rng, N=5, D=4, dk=3, dv=2)
    J = sc.attention_jacobian(X, WQ, WK, WV, mask="causal")
    JX = sc.attention_jacobian(X, WQ, WK, WV, block="x", mask="causal")
    dWQ, dWK, dWV = (rng.standard_normal(w.shape) for w in (WQ, WK, WV))
    dX = rng.standard_normal(X.shape)
    vec = lambda a: a.reshape(-1, order="F")
    dA = sc.attention_jvp(X, WQ, WK, WV, dWQ, dWK, dWV, dX, mask="causal")
    ref = J @ np.concatenate([vec(dWQ), vec(dWK), vec(dWV)]) + JX @ vec(dX)
    assert rel(vec(dA), ref) <= 1e3 * EPS
    only_q = sc.attention_jvp(X, WQ, WK, WV, dWQ=dWQ, mask="causal")
    assert rel(vec(only_q), J[:, :12] @ vec(dWQ)) <= 1e3 * EPS
    G = rng.standard_normal((5, 2))
    g = sc.attention_vjp(X, WQ, WK, WV, G, mask="causal")
    assert isinstance(g, sc.AttentionGradients)
    back = J.T @ vec(G)
    assert rel(vec(g.dWQ), back[:12]) <= 1e3 * EPS
    assert rel(vec(g.dWK), back[12:24]) <= 1e3 * EPS
    assert rel(vec(g.dWV), back[24:]) <= 1e3 * EPS
    assert rel(vec(g.dX), JX.T @ vec(G)) <= 1e3 * EPS


# --- J and J J^T against torch.func.jacrev (MATH.md §3) -----------------------------------

@pytest.mark.parametrize("N,D,dk,dv", [(4, 3, 2, 2), (6, 5, 3, 4), (8, 8, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_jacobian_against_jacrev(rng, N, D, dk, dv, causal):
    X, WQ, WK, WV = instance(rng, N, D, dk, dv)
    mask = "causal" if causal else None
    J = sc.attention_jacobian(X, WQ, WK, WV, mask=mask)
    ref = torch_jacobian(X, WQ, WK, WV, causal=causal)
    assert J.shape == (N * dv, 2 * D * dk + D * dv)
    assert np.max(np.abs(J - ref)) <= 1e-10
    assert np.max(np.abs(J - ref)) <= 1e3 * EPS * np.max(np.abs(ref))
    c = D * dk
    for block, cols in (("q", slice(0, c)), ("k", slice(c, 2 * c)), ("v", slice(2 * c, None))):
        Jb = sc.attention_jacobian(X, WQ, WK, WV, block=block, mask=mask)
        assert np.max(np.abs(Jb - ref[:, cols])) <= 1e-10
    G = sc.attention_gram(X, WQ, WK, WV, mask=mask)
    assert rel(G, ref @ ref.T) <= 1e3 * EPS
    Gq = sc.attention_gram(X, WQ, WK, WV, block="q", mask=mask)
    assert rel(Gq, ref[:, :c] @ ref[:, :c].T) <= 1e3 * EPS


def test_jacobian_scale_one(rng):
    X, WQ, WK, WV = instance(rng, 5, 4, 3, 2)
    J = sc.attention_jacobian(X, WQ, WK, WV, scale=1.0)
    assert np.max(np.abs(J - torch_jacobian(X, WQ, WK, WV, scale=1.0))) <= 1e-10


# --- kappa(J) (MATH.md §12) --------------------------------------------------------------

@pytest.mark.parametrize("method", ["dense", "gram", "iterative", "lobpcg", "qr", "auto"])
def test_kappa_jacobian_against_svd_of_J(rng, method):
    X, WQ, WK, WV = instance(rng, N=6, D=6, dk=4, dv=3)
    s = np.linalg.svd(torch_jacobian(X, WQ, WK, WV), compute_uv=False)
    r = sc.kappa_jacobian(X, WQ, WK, WV, method=method)
    assert isinstance(r, sc.JacobianConditionResult)
    assert r.info == "success", r.note
    assert r.method_requested == method and (r.N, r.D, r.d_k, r.d_v) == (6, 6, 4, 3)
    assert r.scale == pytest.approx(0.5) and r.mask == "none"
    k = s[0] / s[-1]
    # Each method's own stated accuracy, with a factor for the dropped polynomial terms.
    assert abs(r.sigma_max - s[0]) <= 1e-9 * s[0]
    assert abs(r.kappa - k) <= max(100 * r.accuracy, 1e3 * EPS * k) * k
    if method in ("dense", "qr", "lobpcg"):
        assert r.accuracy <= 1e3 * EPS * k


@pytest.mark.parametrize("method", ["dense", "gram", "iterative", "lobpcg", "qr", "matfree",
                                    "auto"])
def test_kappa_jacobian_at_every_scale(rng, method):
    """(X 2^k, W 2^-k) leaves kappa(J) unchanged (MATH.md §3, §4 "Scaling into range"): every
    method gives the unscaled answer at every k with both in range, and never NaN with success
    (k = -1060 would need W 2^1060, beyond double: refused as NaN/Inf input, by name)."""
    X, WQ, WK, WV = instance(rng, N=6, D=6, dk=4, dv=3)
    ref = sc.kappa_jacobian(X, WQ, WK, WV, method="dense")
    assert ref.info == "success"
    for k in (-1060, -1000, -600, -64, 64, 600, 1000):
        Ws = [np.ldexp(W, -k) for W in (WQ, WK, WV)]
        if not all(np.all(np.isfinite(W)) for W in Ws):  # W 2^1060 overflows: refused by name
            with pytest.raises(ValueError, match="W_Q contains NaN or Inf"):
                sc.kappa_jacobian(np.ldexp(X, k), *Ws, method=method)
            continue
        r = sc.kappa_jacobian(np.ldexp(X, k), *Ws, method=method)
        if r.info == "success":
            assert math.isfinite(r.kappa) and r.kappa >= 1, (k, r.note)
        else:
            assert r.info in ("singular", "inaccurate", "not_converging", "invalid_input"), r.info
            assert r.note
        if abs(k) <= 1000:
            assert r.info == "success", (k, r.info, r.note)
            assert abs(r.kappa - ref.kappa) <= max(100 * r.accuracy, 1e3 * EPS * ref.kappa) * \
                ref.kappa, (k, r.kappa, ref.kappa)


def test_kappa_jacobian_float32_computes_in_double(rng):
    X, WQ, WK, WV = instance(rng, N=6, D=6, dk=4, dv=3)
    r64 = sc.kappa_jacobian(*(a.astype(np.float32).astype(np.float64) for a in (X, WQ, WK, WV)),
                            method="dense")
    r32 = sc.kappa_jacobian(*(a.astype(np.float32) for a in (X, WQ, WK, WV)), method="dense")
    assert r32.kappa == pytest.approx(r64.kappa, rel=1e-12)


def test_kappa_jacobian_tall_is_inf(rng):
    X, WQ, WK, WV = instance(rng, N=12, D=2, dk=2, dv=2)  # 24 rows, 12 columns
    r = sc.kappa_jacobian(X, WQ, WK, WV, method="qr")
    assert math.isinf(r.kappa) and r.info == "singular" and r.kappa_plus < math.inf


# --- Theorem 3.4 (MATH.md §5) ------------------------------------------------------------

def test_theorem34_terms_against_numpy(rng):
    X, WQ, WK, WV = instance(rng, N=5, D=6, dk=3, dv=3)
    rep = sc.theorem34(X, WQ, WK, WV)
    assert isinstance(rep, sc.Theorem34Report)
    k = lambda M: (lambda s: s[0] / s[-1])(np.linalg.svd(M, compute_uv=False))
    for name, M in (("X", X), ("WQ", WQ), ("WK", WK), ("WV", WV)):
        assert getattr(rep, name).kappa == pytest.approx(k(M), rel=1e-12)
    Xt = np.asarray(X)
    c = 1 / np.sqrt(3)
    Z = c * (Xt @ WQ) @ (Xt @ WK).T
    P = np.exp(Z - Z.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    assert rep.P.kappa == pytest.approx(k(P), rel=1e-10)
    assert math.isinf(rep.Lambda.kappa) and math.isinf(rep.bound) and rep.vacuous and rep.holds
    s = np.linalg.svd(torch_jacobian(X, WQ, WK, WV), compute_uv=False)
    assert rep.J.kappa == pytest.approx(s[0] / s[-1], rel=1e-9)
    kp = lambda r: r.kappa_plus
    expected = (kp(rep.X) ** 3 * kp(rep.Lambda) * kp(rep.WV) * (kp(rep.WQ) + kp(rep.WK))
                + kp(rep.X) * kp(rep.P))
    assert rep.bound_plus == pytest.approx(expected, rel=1e-12)
    assert rep.ratio_plus == pytest.approx(rep.bound_plus / rep.J.kappa_plus, rel=1e-12)
    assert rep.JQ is not None and rep.verdict
    d = rep.to_dict()
    assert d["J"]["kappa"] == rep.J.kappa and isinstance(d["X"], dict)


# --- the corrections (MATH.md §6–7) ------------------------------------------------------

@pytest.mark.parametrize("shape", [(8, 3), (3, 8)])
def test_exact_correction_against_numpy(rng, shape):
    W = rng.standard_normal(shape)
    U, s, Vt = np.linalg.svd(W, full_matrices=False)
    r = sc.exact_correction(W)
    assert isinstance(r, sc.ExactCorrection)
    np.testing.assert_allclose(r.C, s[0] * U @ Vt, atol=1e3 * EPS * s[0])
    np.testing.assert_allclose(r.W_corrected, W + r.C, atol=0)
    assert r.alpha == pytest.approx(s[0], rel=1e-14)
    assert r.kappa_after == pytest.approx(2 * s[0] / (s[0] + s[-1]), rel=1e-12)
    assert r.kappa_before == pytest.approx(s[0] / s[-1], rel=1e-12)
    t = sc.exact_correction(W, target=1.5)
    assert t.kappa_after == pytest.approx(1.5, rel=1e-10) and t.target == 1.5


def test_lambda_correction_against_numpy(rng):
    W = 0.1 * rng.standard_normal((6, 4))
    r = sc.lambda_correction(W, lam=10)
    E = np.eye(6, 4)
    s = np.linalg.svd(W + 10 * E, compute_uv=False)
    s0 = np.linalg.svd(W, compute_uv=False)
    assert r.kappa_after == pytest.approx(s[0] / s[-1], rel=1e-12)
    assert r.s == pytest.approx(s0[0], rel=1e-14) and r.lam == 10
    assert r.weyl_applies and r.kappa_after <= r.weyl_bound
    assert r.weyl_bound == pytest.approx((10 + s0[0]) / (10 - s0[0]), rel=1e-14)
    assert r.to_dict()["lambda"] == 10
    np.testing.assert_array_equal(r.W_corrected, W + 10 * E)


def test_lambda_identity_placements():
    F = sc.lambda_identity(4, 2, 3, "fused")
    np.testing.assert_array_equal(F, np.eye(4, 6))
    P = sc.lambda_identity(4, 2, 3, "per-head")
    np.testing.assert_array_equal(P, np.hstack([np.eye(4, 3), np.eye(4, 3)]))
    with pytest.raises(ValueError, match="placement"):
        sc.lambda_identity(4, 2, 3, "diagonal")
    # packed: this projection's slice of eye(D, total width) of [W_Q | W_K | W_V], its columns
    # starting at packed_offset there (W_K of D = 8, 2 query heads of 2: offset 4)
    whole = np.eye(8, 4 + 2 + 2)
    np.testing.assert_array_equal(sc.lambda_identity(8, 1, 2, "packed", packed_offset=4),
                                  whole[:, 4:6])
    np.testing.assert_array_equal(sc.lambda_identity(8, 2, 2, "packed"), whole[:, :4])
    np.testing.assert_array_equal(sc.lambda_identity(3, 1, 2, "packed", packed_offset=2),
                                  np.eye(3, 4)[:, 2:])  # partly beyond D: one 1 only
    with pytest.raises(ValueError, match="subset"):
        sc.lambda_identity(4, 2, 3, "fused:qk")
    with pytest.raises(ValueError, match="packed_offset"):
        sc.lambda_identity(4, 2, 3, "fused", packed_offset=1)


def test_result_repr_and_dict(rng):
    r = sc.kappa(np.diag([2.0, 0.0]))
    text = repr(r)
    assert text.startswith("ConditionResult(") and "kappa=inf" in text and "rank=1" in text
    d = r.to_dict()
    assert set(d) >= {"sigma_max", "kappa", "kappa_plus", "rank", "method", "accuracy", "info"}
    assert d["kappa"] == float("inf")
