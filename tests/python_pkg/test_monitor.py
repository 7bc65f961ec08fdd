"""attention_diagnostics against numpy; KappaMonitor against the library's dense kappa(J) at the
activations the test captures itself; its logs (JSON lines, CSV), its budget, and that it changes
neither the model's mode nor the random numbers training draws; spectral_cond.plot's figures."""

import csv
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import spectral_cond as sc
import spectral_cond.torch as sct
from conftest import EPS, instance, torch_jacobian

torch.set_default_dtype(torch.float64)


def np_softmax_P(X, WQ, WK, scale=None):
    c = 1 / np.sqrt(WQ.shape[1]) if scale is None else scale
    Z = c * (X @ WQ) @ (X @ WK).T
    Z = Z - Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    return P / P.sum(axis=1, keepdims=True)


def test_attention_diagnostics_against_numpy(rng):
    X, WQ, WK, WV = instance(rng, N=5, D=7, dk=3, dv=2)
    d = sc.attention_diagnostics(X, WQ, WK, WV)
    P = np_softmax_P(X, WQ, WK)
    m = P.max(axis=1)
    H = -(P * np.log(P)).sum(axis=1)
    assert d.rows == 5
    assert d.row_max_min == pytest.approx(m.min(), rel=1e3 * EPS)
    assert d.row_max_mean == pytest.approx(m.mean(), rel=1e3 * EPS)
    assert d.entropy_mean == pytest.approx(H.mean(), rel=1e3 * EPS)
    assert d.saturated == 0 and not d.collapsed
    # Block norms against numpy's SVD of J's blocks (torch.func.jacrev, column blocks Q, K, V).
    J = torch_jacobian(X, WQ, WK, WV)
    nq, nk = 7 * 3, 7 * 3
    s = lambda M: np.linalg.svd(M, compute_uv=False)[0]
    assert d.norms_converged
    assert d.sigma_max_JQ == pytest.approx(s(J[:, :nq]), rel=1e-6)
    assert d.sigma_max_JK == pytest.approx(s(J[:, nq:nq + nk]), rel=1e-6)
    assert d.sigma_max_JQK == pytest.approx(s(J[:, :nq + nk]), rel=1e-6)
    assert d.sigma_max_JV == pytest.approx(np.linalg.svd(P @ X, compute_uv=False)[0], rel=1e-12)
    assert d.ratio_QK_V == pytest.approx(d.sigma_max_JQK / d.sigma_max_JV, rel=1e-12)
    # The bound without hypothesis holds (N <= D) and is sigma_max(J) / sigma_N(P X).
    sv = np.linalg.svd(J, compute_uv=False)
    b = d.free_bound
    assert b.applicable and b.info == "success"
    assert b.bound >= sv[0] / sv[-1] * (1 - 1e-10)
    assert b.sigma_N_PX == pytest.approx(np.linalg.svd(P @ X, compute_uv=False)[-1], rel=1e-10)
    # The same diagnostics come with theorem34.
    t = sc.theorem34(X, WQ, WK, WV)
    assert t.diagnostics.entropy_mean == pytest.approx(d.entropy_mean, rel=1e-14)
    assert t.free_bound.bound == pytest.approx(b.bound, rel=1e-12)
    assert t.free_bound_holds is True


def test_attention_diagnostics_collapse():
    # W_Q = W_K = 10 I on unit-norm-ish tokens: the softmax is one-hot on the diagonal.
    g = np.random.default_rng(3)
    N, D = 6, 8
    X = g.standard_normal((N, D))
    X = np.sqrt(D) * X / np.linalg.norm(X, axis=1, keepdims=True)
    W = 10 * np.eye(D)
    d = sc.attention_diagnostics(X, W, W, W)
    assert d.collapsed
    assert d.saturated == N and d.saturated_diagonal == N
    assert "collapsed to the identity" in d.note
    assert d.ratio_QK_V < 1e-6
    J = sc.kappa_jacobian(X, W, W, W, method="dense")
    assert J.kappa == pytest.approx(np.linalg.cond(X), rel=1e-6)


def test_attention_diagnostics_float32_and_errors(rng):
    X, WQ, WK, WV = instance(rng, dtype=np.float32)
    d = sc.attention_diagnostics(X, WQ, WK, WV, mask="causal")
    assert 0 < d.row_max_min <= d.row_max_mean <= 1
    with pytest.raises(ValueError, match="attention_diagnostics"):
        sc.attention_diagnostics(X, WQ, WK[:2], WV)


def encoder(seed=0, layers=2, d_model=12, heads=3):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=24, dropout=0.1,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def captured_X(model, x):
    """Each attention module's query input, captured by the test's own hooks (eval mode)."""
    got = []
    mods = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    hs = [m.register_forward_pre_hook(lambda m, a, k: got.append(a[0][0].detach().numpy().copy()),
                                      with_kwargs=True) for m in mods]
    was = model.training
    model.eval()
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused path skips the module's hooks
    with torch.no_grad():
        model(x)
    torch.backends.mha.set_fastpath_enabled(fast)
    model.train(was)
    for h in hs:
        h.remove()
    return got, mods


def test_monitor_against_dense_svd(tmp_path):
    model = encoder()
    model.train()
    x = torch.randn(4, 5, 12)
    log = tmp_path / "kappa.jsonl"
    with sct.KappaMonitor(model, every=2, log=str(log), heads=2, method="auto", seed=7) as mon:
        rng_before = torch.get_rng_state()
        for step in range(5):
            mon(step, x, loss=float(step))
        assert torch.equal(torch.get_rng_state(), rng_before)  # no random numbers drawn
    assert model.training  # mode restored
    recs = mon.records
    assert sorted({r["step"] for r in recs}) == [0, 2, 4]
    layers = [r for r in recs if r["kind"] == "layer"]
    heads = [r for r in recs if r["kind"] == "head"]
    assert len(layers) == 3 * 2 and len(heads) == 3 * 2 * 2
    Xs, mods = captured_X(model, x)
    for r in heads:
        m = mods[r["layer"]]
        W = m.in_proj_weight.detach().numpy()
        d = 4
        h = r["head"]
        wq = W[0:12].T[:, h * d:(h + 1) * d]
        wk = W[12:24].T[:, h * d:(h + 1) * d]
        wv = W[24:36].T[:, h * d:(h + 1) * d]
        J = sc.attention_jacobian(Xs[r["layer"]], wq, wk, wv)
        sv = np.linalg.svd(J, compute_uv=False)
        ref = sv[0] / sv[-1]
        assert r["info"] == "success", r
        assert abs(r["kappa_J"] - ref) / ref <= r["accuracy"] + 1e3 * EPS * ref, r
        assert r["kappa_WQ"] == pytest.approx(np.linalg.cond(wq), rel=1e-10)
        assert r["loss"] == float(r["step"])
        assert 0 < r["row_max_mean"] <= 1 and r["collapsed"] is False
        assert r["free_bound"] >= r["kappa_J"] * (1 - 1e-8)
    for r in layers:
        W = mods[r["layer"]].in_proj_weight.detach().numpy()
        assert r["kappa_WV"] == pytest.approx(np.linalg.cond(W[24:36].T), rel=1e-10)
    # The same heads at the same step for the same seed; the log holds every record.
    back = sct.read_monitor_log(str(log))
    assert len(back) == len(recs)
    assert [(r["step"], r["layer"], r.get("head")) for r in back] == \
        [(r["step"], r["layer"], r.get("head")) for r in recs]
    for a, b in zip(back, recs):
        if b["kind"] == "head":
            assert a["kappa_J"] == b["kappa_J"]


def test_monitor_sees_the_correction_and_writes_csv(tmp_path):
    model = encoder(seed=1)
    sct.spectral_conditioning(model, method="lambda", lam=10.0, placement="fused")
    x = torch.randn(2, 5, 12)
    log = tmp_path / "kappa.csv"
    mon = sct.KappaMonitor(model, every=1, log=str(log), heads=None)
    mon(0, x)
    mon.close()
    m = next(mm for mm in model.modules() if isinstance(mm, nn.MultiheadAttention))
    Weff = m.in_proj_weight.detach().numpy()  # the parametrized W + C
    rows = list(csv.DictReader(open(log)))
    assert len(rows) == 2 + 2 * 3
    first = [r for r in rows if r["kind"] == "layer" and r["layer"] == "0"][0]
    assert float(first["kappa_WQ"]) == pytest.approx(np.linalg.cond(Weff[0:12].T), rel=1e-10)
    assert float(first["kappa_WQ"]) < 2  # 10 I dominates W
    assert first["head"] == ""  # layer rows leave the head columns empty
    head_rows = [r for r in rows if r["kind"] == "head"]
    assert {r["head"] for r in head_rows} == {"0", "1", "2"}
    for r in head_rows:
        assert r["info"] in ("success", "singular")
        assert r["collapsed"] in ("True", "False")


def test_monitor_budget_and_bad_arguments():
    model = encoder(seed=2)
    x = torch.randn(1, 5, 12)
    mon = sct.KappaMonitor(model, every=1, heads=None, budget_s=1e-9)
    recs = [r for r in mon.measure(x) if r["kind"] == "head"]
    assert recs and all(r["info"] in ("skipped", "budget") for r in recs)
    assert all(math.isnan(r["kappa_J"]) for r in recs)
    assert mon.overhead_s > 0
    assert mon(1, x) is not None and mon(1, x)[0]["step"] == 1
    with pytest.raises(ValueError, match="every"):
        sct.KappaMonitor(model, every=0)
    with pytest.raises(ValueError, match="budget_s"):
        sct.KappaMonitor(model, budget_s=0)
    with pytest.raises(ValueError, match=r"\.jsonl, \.json or \.csv"):
        sct.KappaMonitor(model, log="kappa.txt")
    with pytest.raises(ValueError, match="no attention module"):
        sct.KappaMonitor(nn.Linear(3, 3))


def test_analyze_model_has_diagnostics_and_pandas():
    pd = pytest.importorskip("pandas")
    model = encoder(seed=4)
    x = torch.randn(1, 6, 12)
    res = sct.analyze_model(model, x)
    assert all(r.diagnostics is not None for r in res)
    df = res.to_pandas()
    assert isinstance(df, pd.DataFrame)
    assert len(df) == 2 * 3
    for col in ("kappa_J", "row_max_mean", "entropy_mean", "ratio_QK_V", "collapsed",
                "free_bound"):
        assert col in df.columns
    assert (df["free_bound"] >= df["kappa_J"] * (1 - 1e-8)).all()


def test_plots(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import spectral_cond.plot as scp

    model = encoder(seed=5)
    x = torch.randn(1, 5, 12)
    res = sct.analyze_model(model, x)
    ax = scp.heatmap(res, value="kappa_J")
    img = ax.images[0].get_array()
    assert img.shape == (2, 3)
    assert img[1, 2] == pytest.approx(math.log10(res[5].kappa_J))
    log = tmp_path / "m.jsonl"
    mon = sct.KappaMonitor(model, every=1, log=str(log), heads=None)
    for s in range(3):
        mon(s, x)
    mon.close()
    ax = scp.monitor(str(log))
    assert len(ax.lines) == 2  # one median line per layer
    ax2 = scp.heatmap(mon.records, step=1)
    assert ax2.images[0].get_array().shape == (2, 3)
    W = np.random.default_rng(0).standard_normal((12, 4))
    ax3 = scp.spectra(W, {"W + 10 I": sc.lambda_correction(W, 10.0).W_corrected})
    assert len(ax3.lines) == 2 and "kappa" in ax3.get_legend().get_texts()[0].get_text()
    out = tmp_path / "heat.png"
    ax.figure.savefig(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close("all")
    with pytest.raises(ValueError, match="no records at step 9"):
        scp.heatmap(mon.records, step=9)
