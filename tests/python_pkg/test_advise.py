"""The λ advisor from Python (MATH.md §17): advise_head's grid points against numpy's SVD of J from
torch.func.jacrev on weights corrected here by hand, the diagnostics against P computed by numpy,
spectral_cond.torch.advise on live models (its packed identity is qkv.weight + λ eye(3D, D)
built here), the recommendation applied by spectral_conditioning(advice=...), the miniature ViT
of experiments/ at initialisation, the plot, and bad arguments."""

import math
import os
import sys

import numpy as np
import pytest
import torch

import spectral_cond as sc
import spectral_cond.torch as sct
from conftest import HFSelfAttention, TimmAttention, torch_jacobian

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def layer_normed(rng, N, D):
    X = rng.standard_normal((N, D))
    X -= X.mean(axis=1, keepdims=True)
    return X / np.sqrt((X ** 2).mean(axis=1, keepdims=True))


def softmax_rows(Z):
    Z = Z - Z.max(axis=1, keepdims=True)
    E = np.exp(Z)
    return E / E.sum(axis=1, keepdims=True)


def numpy_kappa(M):
    s = np.linalg.svd(M, compute_uv=False)
    return math.inf if s[-1] == 0 else s[0] / s[-1]


def corrected(W, r0, lam):
    """W + lam E with E the shifted identity: ones at (r0 + j, j) inside W's rows."""
    C = W.copy()
    for j in range(W.shape[1]):
        if r0 >= 0 and r0 + j < W.shape[0]:
            C[r0 + j, j] += lam
    return C


def test_advise_head_points_against_jacrev_and_numpy():
    rng = np.random.default_rng(3)
    N, D, d, heads, head = 6, 8, 2, 4, 2
    X = layer_normed(rng, N, D)
    WQ, WK, WV = (0.3 * rng.standard_normal((D, d)) for _ in range(3))
    a = sc.advise_head(X, WQ, WK, WV, head=head, heads=heads, lambdas=[0, 0.5, 3],
                       placements=["fused", "per_head:qk", "packed"])
    assert len(a.points) == 9
    offsets = {"fused": (4, 4, 4), "per_head:qk": (0, 0, -1), "packed": (4, 8 + 4, 16 + 4)}
    for p in a.points:
        r = offsets[p.placement]
        q, k, v = (corrected(W, r0, p.lam) for W, r0 in zip((WQ, WK, WV), r))
        ref = numpy_kappa(torch_jacobian(X, q, k, v))
        assert p.J.info == "success"
        assert abs(p.J.kappa - ref) <= max(p.J.accuracy, 1e-12) * ref, (p.placement, p.lam)
        for got, W in zip((p.kappa_WQ, p.kappa_WK, p.kappa_WV), (q, k, v)):
            assert got == pytest.approx(numpy_kappa(W), rel=1e-12)
        P = softmax_rows((X @ q) @ (X @ k).T / math.sqrt(d))
        assert p.diagnostics.saturated_fraction == np.mean(P.max(axis=1) > 1 - 1e-6)
        assert p.diagnostics.row_max_mean == pytest.approx(P.max(axis=1).mean(), rel=1e-12)
    assert a.best.found and "kappa(J)" in a.best.reason
    rows = a.to_pandas()
    assert len(rows) == 9 and set(rows["placement"]) == {"fused", "per_head:qk", "packed"}


def test_every_lambda_saturating_gives_none_with_the_reason():
    rng = np.random.default_rng(5)
    X = layer_normed(rng, 8, 8)
    W = 6 * np.eye(8)
    a = sc.advise_head(X, W, W, 0.3 * rng.standard_normal((8, 8)), lambdas=[0, 1, 2],
                       placements=["fused"])
    assert not a.best.found
    assert a.best.reason.startswith("none") and "saturated" in a.best.reason
    with pytest.raises(ValueError, match="recommends no lambda"):
        sct.spectral_conditioning(TimmAttention(8, 1), advice=_FakeAdvice(a.best))


class _FakeAdvice:
    def __init__(self, best):
        self.best = best


def test_torch_advise_on_a_packed_model_against_a_hand_built_packed_identity():
    torch.manual_seed(0)
    D, H, N = 8, 2, 6
    model = TimmAttention(D, H).double()
    with torch.no_grad():
        model.qkv.weight.mul_(0.1)
    x = torch.tensor(layer_normed(np.random.default_rng(1), N, D))[None]
    res = sct.advise(model, x, lambdas=[0, 0.5, 2], heads="all")
    assert res.placements == ["fused", "per_head", "packed"]  # one packed qkv: packed offered
    assert len(res) == H
    Wp = model.qkv.weight.detach().numpy()  # 3D x D, rows Q, K, V
    X = x[0].numpy()
    d = D // H
    for ha in res:
        for p in (q for q in ha.points if q.placement == "packed"):
            Wc = Wp + p.lam * np.eye(3 * D, D)  # qkv.weight + lam eye(3D, D), as the paper reads it
            sl = lambda blk: Wc[blk * D + ha.head * d: blk * D + (ha.head + 1) * d].T
            ref = numpy_kappa(torch_jacobian(X, sl(0), sl(1), sl(2)))
            assert abs(p.J.kappa - ref) <= max(p.J.accuracy, 1e-12) * ref
    # The recommendation over both heads, applied: the effective qkv weight is W + lam E.
    assert res.best.found, res.best.reason
    W0 = model.qkv.weight.detach().clone()
    sct.spectral_conditioning(model, advice=res)
    layout, _, subset = res.best.placement.partition(":")
    eff = model.qkv.weight.detach()
    if layout == "packed":
        want = W0 + res.best.lam * torch.eye(3 * D, D, dtype=W0.dtype)
        assert torch.equal(eff, want)
    else:
        assert not torch.equal(eff, W0) or res.best.lam == 0
    sct.remove(model, fold=False)
    assert "heads" in res.sampling and "all heads" in res.sampling


def test_packed_is_refused_on_separate_projections_and_bad_grids_name_the_argument():
    torch.manual_seed(0)
    model = HFSelfAttention(8, 2, bias=False).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="placements.*packed|packed.*separate"):
        sct.advise(model, x, placements=["packed"])
    res = sct.advise(model, x, lambdas=[0, 1], heads=1, seed=3)
    assert res.placements == ["fused", "per_head"]  # no packed tensor: packed not offered
    assert len(res) == 1 and "seed 3" in res.sampling
    for bad, what in (([], "lambdas"), ([1, -1], "lambdas"), ([math.nan], "lambdas"),
                      ([math.inf], "lambdas")):
        with pytest.raises(ValueError, match=what):
            sct.advise(model, x, lambdas=bad)
    with pytest.raises(ValueError, match="placements"):
        sct.advise(model, x, placements=["diagonal"])
    with pytest.raises(ValueError, match="placements"):
        sct.advise(model, x, placements=[])
    with pytest.raises(ValueError, match="lambdas"):
        sc.advise_head(np.eye(3), np.eye(3), np.eye(3), np.eye(3), lambdas=[])
    with pytest.raises(ValueError, match="placements"):
        sc.advise_head(np.eye(3), np.eye(3), np.eye(3), np.eye(3), placements=["fused:x"])
    with pytest.raises(ValueError, match="placement"):
        sct.spectral_conditioning(model, placement="packed")


def test_miniature_vit_at_initialisation_is_not_advised_lambda_10_fused():
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    try:
        from data import digits
        from models import ViT
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = ViT(32, 3, 4, 64).double().eval()  # the vision experiment's shape (d_k = 8, N = 17)
    images = digits().train_x[:4].to(torch.float64)
    res = sct.advise(model, images, lambdas=[0, 0.5, 1, 2, 5, 10], heads=2, seed=0)
    assert len(res) == 6
    assert res.best.found, res.best.reason
    assert not (res.best.lam == 10 and res.best.placement == "fused")
    # λ = 10 fused saturates every advised head (self-logits near λ² sqrt(d_k) ≈ 280).
    for ha in res:
        p10 = next(p for p in ha.points if p.lam == 10 and p.placement == "fused")
        assert not p10.admissible and p10.diagnostics.saturated_fraction > 0.5
        i = ha.placements.index("fused")
        assert ha.predicted_onset[i] == pytest.approx(
            math.sqrt(math.log((ha.N - 1) / 1e-6) / (ha.scale * ha.d_k * ha.token_variance[i])))


def test_plot_advice_marks_the_recommendation():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import spectral_cond.plot as scplot

    rng = np.random.default_rng(2)
    X = layer_normed(rng, 6, 8)
    W = [0.1 * rng.standard_normal((8, 4)) for _ in range(3)]
    a = sc.advise_head(X, *W, lambdas=[0, 0.5, 1, 4], placements=["fused", "per_head"])
    ax_k, ax_s = scplot.advice(a)
    labels = [l.get_label() for l in ax_k.get_lines()]
    assert "fused" in labels and "per_head" in labels
    assert ("recommended" in labels) == a.best.found
    assert "lambda" in ax_s.get_xlabel()
