"""spectral_cond.torch: the paper's conditioning as a drop-in (outputs equal to the folded model,
gradients equal to autograd through W + C) and analyze_model against the library called on the
inputs computed by hand and against numpy's SVD of J from torch.func.jacrev."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import spectral_cond as sc
import spectral_cond.torch as sct
from conftest import HFSelfAttention, TimmAttention, torch_jacobian

torch.set_default_dtype(torch.float64)


class Blocks(nn.Module):
    def __init__(self, *mods):
        super().__init__()
        self.blocks = nn.ModuleList(mods)
        self.norm = nn.LayerNorm(mods[0].qkv.in_features if hasattr(mods[0], "qkv") else 8)

    def forward(self, x):
        for b in self.blocks:
            x = self.norm(x + b(x))
        return x


def models():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=False)
    mha = nn.MultiheadAttention(8, 4, batch_first=True)

    class MHAModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    return {
        "encoder": enc,
        "mha": MHAModel(),
        "timm": Blocks(TimmAttention(8, 2), TimmAttention(8, 2, qkv_bias=True)),
        "hf": Blocks(HFSelfAttention(8, 2), HFSelfAttention(8, 4, bias=False)),
    }


def weight_tensors(model):
    """(module, param name) of every weight tensor that holds W_Q, W_K or W_V."""
    return sorted({(id(p.owner), p.param): (p.owner, p.param)
                   for s in sct.find_attention(model) for p in (s.q, s.k, s.v)}.values(),
                  key=lambda t: id(t[0]))


@pytest.mark.parametrize("kind", ["encoder", "mha", "timm", "hf"])
@pytest.mark.parametrize("method", ["lambda", "exact"])
@pytest.mark.parametrize("placement", ["fused", "per-head"])
def test_conditioning_forward_equals_folded_and_gradients_flow_to_W(kind, method, placement):
    model = models()[kind]
    model.eval()
    original = copy.deepcopy(model)
    x = torch.randn(2, 5, 8)
    sct.spectral_conditioning(model, method=method, lam=10.0, placement=placement)
    # The corrections C, read back from the parametrizations.
    C = {}
    for owner, param in weight_tensors(model):
        C[(id(owner), param)] = owner.parametrizations[param][0].C
    # 1. forward equals the folded model's
    folded = sct.remove(copy.deepcopy(model), fold=True)
    out = model(x)
    assert torch.equal(out, folded(x))
    # 2. gradients equal autograd through W + C of the unconditioned model
    loss = (out ** 2).sum()
    loss.backward()
    names = {id(m): n for n, m in original.named_modules()}
    ref_params = dict(original.named_parameters())
    leaf = {k: v.detach().clone().requires_grad_(True) for k, v in ref_params.items()}
    eff = dict(leaf)
    cond_names = {id(m): n for n, m in model.named_modules()}
    for owner, param in weight_tensors(model):
        full = f"{cond_names[id(owner)]}.{param}".lstrip(".")
        eff[full] = leaf[full] + C[(id(owner), param)]
    ref_out = torch.func.functional_call(original, eff, (x,))
    assert torch.allclose(ref_out, out, rtol=0, atol=1e-12)
    (ref_out ** 2).sum().backward()
    for owner, param in weight_tensors(model):
        full = f"{cond_names[id(owner)]}.{param}".lstrip(".")
        g = owner.parametrizations[param].original.grad
        assert g is not None
        assert torch.allclose(g, leaf[full].grad, rtol=1e-12, atol=1e-12)
    # 3. the correction is fixed (a buffer, not a parameter) and W itself is trained
    assert all("C" not in n.split(".")[-1] for n, _ in model.named_parameters())
    del names


@pytest.mark.parametrize("placement", ["fused", "per-head"])
def test_lambda_correction_is_lambda_times_the_rectangular_identity(placement):
    model = models()["timm"]
    sct.spectral_conditioning(model, method="lambda", lam=3.0, placement=placement)
    att = model.blocks[0]
    C = att.qkv.parametrizations["weight"][0].C  # 3D x D, rows Q, K, V; W = weight.T
    E = sc.lambda_identity(8, 2, 4, placement)
    for b in range(3):
        np.testing.assert_array_equal(C[8 * b:8 * (b + 1)].T.numpy(), 3.0 * E)
    if placement == "per-head":
        np.testing.assert_array_equal(E[:, 4:], np.eye(8, 4))


def test_exact_correction_per_head_gives_kappa_at_most_two():
    model = models()["hf"]
    before = [p.W() for s in sct.find_attention(model) for p in (s.q, s.k, s.v)]
    sct.spectral_conditioning(model, method="exact", placement="per-head")
    sites = sct.find_attention(model)
    after = [p.W() for s in sites for p in (s.q, s.k, s.v)]
    heads = [s.heads for s in sites for _ in range(3)]
    for W0, W1, h in zip(before, after, heads):
        d = W0.shape[1] // h
        for j in range(h):
            s = np.linalg.svd(W0[:, j * d:(j + 1) * d], compute_uv=False)
            s1 = np.linalg.svd(W1[:, j * d:(j + 1) * d], compute_uv=False)
            assert s1[0] / s1[-1] == pytest.approx(2 * s[0] / (s[0] + s[-1]), rel=1e-10)
            assert s1[0] / s1[-1] <= 2 + 1e-12


def test_exact_fused_and_remove_without_fold_restores_W():
    model = models()["mha"]
    W0 = model.attn.in_proj_weight.detach().clone()
    sct.spectral_conditioning(model, method="exact", placement="fused")
    W = model.attn.in_proj_weight.detach()
    s = np.linalg.svd(W[:8].T.numpy(), compute_uv=False)
    s0 = np.linalg.svd(W0[:8].T.numpy(), compute_uv=False)
    assert s[0] / s[-1] == pytest.approx(2 * s0[0] / (s0[0] + s0[-1]), rel=1e-10)
    with pytest.raises(ValueError, match="already parametrized"):
        sct.spectral_conditioning(model)
    sct.remove(model, fold=False)
    assert torch.equal(model.attn.in_proj_weight, W0)
    with pytest.raises(ValueError, match="not spectrally conditioned"):
        sct.remove(model)


def _exact_C_numpy(W, heads):
    """sigma_1 U V^T of each head block of W (D x heads d), by numpy's SVD: the reference."""
    C = np.zeros_like(W)
    d = W.shape[1] // heads
    for j in range(heads):
        U, s, Vt = np.linalg.svd(W[:, j * d:(j + 1) * d], full_matrices=False)
        C[:, j * d:(j + 1) * d] = s[0] * U @ Vt
    return C


@pytest.mark.parametrize("every", [1, 3])
def test_exact_refresh_every_recomputes_C_from_the_trained_W(every):
    """refresh_every=k: before every k-th training forward pass after the first, C is
    sigma_1 U V^T of the current W (per head block here); in between C stays fixed, eval passes
    do not count, and remove() drops the hook."""
    model = models()["hf"]
    sct.spectral_conditioning(model, method="exact", placement="per_head", refresh_every=every)
    site = sct.find_attention(model)[0]
    q = site.q
    orig = q.owner.parametrizations[q.param].original
    fc = q.owner.parametrizations[q.param][0]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(2, 5, 8)
    model.eval()
    model(x)  # not a training pass
    model.train()
    C_before = fc.C.clone()
    for step in range(1, 2 * every + 2):
        W_now = q.W(orig)  # the W this forward pass sees, before any refresh
        C_prev = fc.C.clone()
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
        # forward pass number `step` (1-based) refreshed when step - 1 is a positive multiple
        refreshed = step > 1 and (step - 1) % every == 0
        if refreshed:
            want = _exact_C_numpy(W_now, site.heads)
            np.testing.assert_allclose(fc.C.numpy().T, want, rtol=0,
                                       atol=1e-12 * np.abs(want).max())
            assert not torch.equal(fc.C, C_prev)
        else:
            assert torch.equal(fc.C, C_prev)
    assert not torch.equal(fc.C, C_before)
    assert sct.refresh(model) == len(weight_tensors(model))
    sct.remove(model, fold=True)
    assert not model._forward_pre_hooks
    with pytest.raises(ValueError, match="refresh_every applies to method 'exact'"):
        sct.spectral_conditioning(models()["hf"], method="lambda", refresh_every=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="refresh_every must be an integer"):
            sct.spectral_conditioning(models()["hf"], method="exact", refresh_every=bad)


def test_training_step_updates_W_not_C():
    model = models()["encoder"]
    sct.spectral_conditioning(model, lam=10.0)
    layer = model.layers[0].self_attn
    C = layer.parametrizations["in_proj_weight"][0].C.clone()
    W = layer.parametrizations["in_proj_weight"].original.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 5, 8)).pow(2).sum().backward()
    opt.step()
    assert torch.equal(layer.parametrizations["in_proj_weight"][0].C, C)
    assert not torch.equal(layer.parametrizations["in_proj_weight"].original, W)


def test_bad_arguments():
    with pytest.raises(ValueError, match="method must be 'lambda' or 'exact'"):
        sct.spectral_conditioning(models()["mha"], method="svd")
    with pytest.raises(ValueError, match="placement"):
        sct.spectral_conditioning(models()["mha"], placement="diagonal")
    with pytest.raises(ValueError, match="no attention module"):
        sct.spectral_conditioning(nn.Linear(3, 3))


def test_analyze_model_mha_against_jacrev_svd():
    model = models()["mha"]
    with torch.no_grad():  # trained-like biases (PyTorch initialises them to zero)
        model.attn.in_proj_bias.copy_(torch.randn(24, dtype=model.attn.in_proj_bias.dtype))
    x = torch.randn(3, 6, 8)
    res = sct.analyze_model(model, x, sample=1)
    assert isinstance(res, sct.ModelAnalysis) and len(res) == 4
    W = model.attn.in_proj_weight.detach().numpy()
    B = model.attn.in_proj_bias.detach().numpy()
    WQ, WK, WV = W[:8].T, W[8:16].T, W[16:].T
    X = x[1].numpy()
    for r in res:
        h = r.head
        wq, wk, wv = (w[:, 2 * h:2 * h + 2] for w in (WQ, WK, WV))
        b = tuple(B[o + 2 * h:o + 2 * h + 2] for o in (0, 8, 16))
        s = np.linalg.svd(torch_jacobian(X, wq, wk, wv, biases=b), compute_uv=False)
        assert r.kappa_J == pytest.approx(s[0] / s[-1], rel=1e-9)
        sq = np.linalg.svd(wq, compute_uv=False)
        assert r.kappa_WQ == pytest.approx(sq[0] / sq[-1], rel=1e-12)
        assert r.has_bias and "with the module's biases" in r.note and not r.rope
        assert (r.N, r.D, r.d_k) == (6, 8, 2) and r.jacobian.method == r.method
    df = res.to_pandas()
    assert list(df["head"]) == [0, 1, 2, 3] and "kappa_J" in df.columns


def test_analyze_model_captures_each_layers_real_input():
    model = models()["encoder"]
    model.eval()
    x = torch.randn(2, 5, 8)
    res = sct.analyze_model(model, x)
    assert [(r.layer, r.head) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with torch.no_grad():
        X1 = model.layers[0](x)[0].numpy()  # the input of layer 1's self-attention
    att = model.layers[1].self_attn
    W = att.in_proj_weight.detach().numpy()
    for r in res[2:]:
        h = r.head
        w = [W[8 * b:8 * (b + 1)].T[:, 4 * h:4 * h + 4] for b in range(3)]
        direct = sc.kappa_jacobian(X1, *w)
        assert r.kappa_J == pytest.approx(direct.kappa, rel=1e-12)
        assert r.name == "layers.1.self_attn"


def test_analyze_model_timm_and_hf_and_flags():
    for kind in ("timm", "hf"):
        model = models()[kind]
        res = sct.analyze_model(model, torch.randn(1, 7, 8), jacobian=True)
        assert all(math.isfinite(r.kappa_J) or r.info != "success" for r in res)
        heads = [s.heads for s in sct.find_attention(model)]
        assert len(res) == sum(heads)
    res = sct.analyze_model(models()["timm"], torch.randn(1, 7, 8))
    assert [r.has_bias for r in res] == [False, False, True, True]


def test_analyze_model_after_conditioning_sees_effective_weights():
    model = models()["hf"]
    x = torch.randn(1, 6, 8)
    before = sct.analyze_model(model, x, jacobian=False)
    sct.spectral_conditioning(model, method="exact", placement="per-head")
    after = sct.analyze_model(model, x, jacobian=False)
    for b, a in zip(before, after):
        assert a.kappa_WQ <= 2 + 1e-12 and a.kappa_WQ <= b.kappa_WQ + 1e-12
        assert math.isnan(a.kappa_J) and a.info == "not_computed"


def test_analyze_model_weights_only_does_not_run_the_model():
    model = models()["hf"]
    calls = []
    hook = model.register_forward_hook(lambda *args: calls.append(1))
    weights = sct.analyze_model(model, None, jacobian=False)
    hook.remove()
    assert calls == []
    full = sct.analyze_model(model, torch.randn(1, 6, 8))
    assert len(weights) == len(full) > 0
    for w, f in zip(weights, full):
        assert (w.kappa_WQ, w.kappa_WK, w.kappa_WV) == (f.kappa_WQ, f.kappa_WK, f.kappa_WV)
        assert w.N == 0 and w.info == "not_computed"
