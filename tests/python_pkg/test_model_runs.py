"""Runs that never silently lie: a head that cannot be computed is recorded with its reason and
the analysis goes on; a singular J is +inf (matfree included) or a decline that says why; an impossible request
is declined from its shapes; the per-layer summary; a conditioned model saved as users save it
(state_dict, save_pretrained, torch.save) keeps W + C or is refused with the way out."""

import math
import pathlib

import numpy as np
import pytest
import torch
from torch import nn

import spectral_cond as sc
import spectral_cond.torch as sct

import transformers  # noqa: E402  (scripts/setup-python installs it: a missing one fails)

CASE = pathlib.Path(__file__).resolve().parents[1] / "data" / "cases" / "minilm-after-lambda"
IDS = torch.tensor([[5, 17, 3, 42, 8, 29, 11, 60, 2]])


def llama(**kw):
    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)
    cfg.update(kw)
    torch.manual_seed(0)
    return transformers.LlamaModel(transformers.LlamaConfig(**cfg))


@pytest.mark.parametrize("method", ["auto", "lobpcg", "qr", "matfree", "gram"])
def test_minilm_after_lambda_is_singular_or_declined_never_an_error(method):
    """A trained head after W + 10 I (float32, as the model holds it): J has rank 288 of 352.
    It raised an eigensolver error by auto, lobpcg and qr, and gave NaN by matfree."""
    X, WQ, WK, WV = (np.load(CASE / f"{n}.npy") for n in ("X", "WQ", "WK", "WV"))
    b = tuple(np.load(CASE / f"{n}.npy")[:, 0] for n in ("bq", "bk", "bv"))
    r = sc.kappa_jacobian(X, WQ, WK, WV, biases=b, method=method)
    assert r.info in ("singular", "not_converging", "inaccurate"), (r.info, r.note)
    if r.info == "singular":
        assert math.isinf(r.kappa)
    else:  # a decline says why (gram: an uncertain rank is never a singular verdict)
        assert r.note


def test_a_failing_head_is_recorded_and_the_run_goes_on(monkeypatch):
    model = llama()
    real = sc.kappa_jacobian
    calls = []

    def flaky(X, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("eigensolver exploded")
        return real(X, *a, **kw)

    monkeypatch.setattr(sc, "kappa_jacobian", flaky)
    res = sct.analyze_model(model, {"input_ids": IDS}, diagnostics=False)
    assert len(res) == 8
    bad = [r for r in res if r.info == "failed"]
    assert len(bad) == 1 and (bad[0].layer, bad[0].head) == (0, 2)
    assert "layer 0 (layers.0.self_attn), head 2: RuntimeError: eigensolver exploded" in bad[0].note
    assert all(r.info in ("success", "singular") for r in res if r is not bad[0])
    assert "failed" in str(res.summary())


def test_an_impossible_request_is_declined_with_its_sizes():
    class Attn(nn.Module):  # timm's layout: one head of 64 over D = 64
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim, self.scale = 1, 64, 0.125
            self.qkv = nn.Linear(64, 192)
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return self.proj(torch.softmax(q @ k.transpose(-1, -2) * self.scale, -1) @ v)

    torch.manual_seed(1)
    res = sct.analyze_model(Attn(), torch.randn(1, 64, 64), memory_budget=100_000)
    assert res[0].info == "too_large" and math.isnan(res[0].kappa_J)
    assert "N = 64, D = 64, d_k = 64, d_v = 64" in res[0].note
    assert "before allocating" in res[0].note
    ok = sct.analyze_model(Attn(), torch.randn(1, 64, 64), diagnostics=False)
    assert ok[0].info == "success" and "auto chose" in ok[0].note


def test_summary_per_layer():
    model = llama()
    with torch.no_grad():  # a saturating correction on layer 1 only
        model.layers[1].self_attn.q_proj.weight.mul_(100.0)
        model.layers[1].self_attn.k_proj.weight.mul_(100.0)
    res = sct.analyze_model(model, {"input_ids": IDS})
    s = res.summary()
    assert [r["layer"] for r in s.rows] == [0, 1]
    for row, layer in zip(s.rows, (0, 1)):
        rs = [r for r in res if r.layer == layer]
        ks = [r.kappa_J for r in rs]
        assert row["heads"] == 4 and row["answered"] == 4
        assert row["median_kappa_J"] == pytest.approx(float(np.median(ks)))
        assert row["worst_kappa_J"] == max(ks)
        assert row["saturated"] == sum(r.diagnostics.saturated_fraction > 0.01 for r in rs)
    assert s.rows[1]["saturated"] > s.rows[0]["saturated"]
    assert s.rows[0]["saturated"] == 0  # row 0 of a causal mask is forced, not saturated
    text = str(s)
    assert "median κ(J)" in text and "layer" in text.splitlines()[0]
    assert list(s.to_pandas()["layer"]) == [0, 1]


def conditioned(kind="bert"):
    torch.manual_seed(2)
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        model = llama()
    model.eval()
    return sct.spectral_conditioning(model, method="lambda", lam=3.0)


def test_state_dict_round_trips_into_conditioned_and_plain_models():
    model = conditioned()
    sd = model.state_dict()
    name = "encoder.layer.0.attention.self.query"
    assert f"{name}.parametrizations.weight.original" in sd
    assert f"{name}.parametrizations.weight.0.C" in sd
    folded = sd[f"{name}.weight"]
    assert torch.equal(folded, sd[f"{name}.parametrizations.weight.original"]
                       + sd[f"{name}.parametrizations.weight.0.C"])
    out = model(input_ids=IDS).last_hidden_state
    # Into a model conditioned the same way: W and C restored, strictly.
    again = conditioned()
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    again.load_state_dict(sd)
    assert torch.equal(again(input_ids=IDS).last_hidden_state, out)
    # Into a plain model: the folded W + C under the plain names.
    torch.manual_seed(3)
    plain = transformers.BertModel(model.config, add_pooling_layer=False).eval()
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert not missing and all("parametrizations" in k for k in unexpected)
    assert torch.allclose(plain(input_ids=IDS).last_hidden_state, out, rtol=0, atol=1e-6)
    # A folded copy that contradicts W + C is an error, not a silent choice.
    bad = dict(sd)
    bad[f"{name}.weight"] = folded + 1
    with pytest.raises(RuntimeError, match="is not .*original \\+ C"):
        conditioned().load_state_dict(bad)


def test_save_pretrained_then_from_pretrained_into_a_plain_model(tmp_path):
    model = conditioned("llama")
    out = model(input_ids=IDS).last_hidden_state
    model.save_pretrained(tmp_path)
    plain = transformers.LlamaModel.from_pretrained(tmp_path).eval()
    assert not any(p.__class__.__name__.startswith("Parametrized") for p in plain.modules())
    assert torch.allclose(plain(input_ids=IDS).last_hidden_state, out, rtol=0, atol=1e-5)
    # ... and back into a conditioned model, W and C restored exactly.
    again = conditioned("llama")
    again.load_state_dict(plain.state_dict() | model.state_dict())
    assert torch.equal(again(input_ids=IDS).last_hidden_state, out)


def test_torch_save_of_the_whole_model_is_refused_with_the_way_out(tmp_path):
    model = conditioned()
    with pytest.raises(RuntimeError, match=r"remove\(model, fold=True\)"):
        torch.save(model, tmp_path / "m.pt")
    sct.remove(model, fold=True)
    torch.save(model, tmp_path / "m.pt")  # a plain model again
    state = model.state_dict()
    assert not any("parametrizations" in k for k in state)


def test_theorem34_per_head_reuses_kappa_J_and_the_summary_counts_verdicts():
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(8, 2, bias=False, batch_first=True)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = mha

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    x = torch.randn(1, 5, 8)
    res = sct.analyze_model(M(), x, theorem34=True)
    W = mha.in_proj_weight.detach().double().numpy()
    for r in res:
        cols = [slice(j * 8 + 4 * r.head, j * 8 + 4 * r.head + 4) for j in range(3)]
        t = sc.theorem34(x[0].double().numpy(), *(W[c].T for c in cols))  # computes kappa(J)
        assert r.theorem34.bound_applies and t.bound_applies
        assert r.theorem34.bound_plus == pytest.approx(t.bound_plus, rel=1e-8)
        assert r.theorem34.J.kappa == r.kappa_J  # reused, not recomputed
    counts = res.summary().rows[0]["theorem34"]
    assert counts and sum(int(w.split()[-1]) for w in counts.split(", ")) == 2
    assert "theorem34" in str(res.summary())
    # With RoPE and a causal mask the theorem is not stated: not_applicable.
    dec = sct.analyze_model(llama(), {"input_ids": IDS}, theorem34=True, diagnostics=False)
    assert all(r.flat()["theorem34"] == "not_applicable" for r in dec if r.info == "success")


@pytest.mark.parametrize("placement", ["fused", "per-head"])
def test_spectral_conditioning_on_gpt2_conv1d_and_neox_fused_rows(placement):
    """C lands on each projection's own columns of GPT-2's D x 3D Conv1D weight, and on each
    head's own rows of GPT-NeoX's per-head [q, k, v] layout."""
    torch.manual_seed(5)
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1,
                                                          n_head=4))
    sct.spectral_conditioning(gpt2, lam=2.0, placement=placement)
    C = gpt2.h[0].attn.c_attn.parametrizations.weight[0].C  # D x 3D, columns Q, K, V
    E = sc.lambda_identity(32, 4, 8, placement)
    for j in range(3):
        np.testing.assert_array_equal(C[:, 32 * j:32 * (j + 1)].numpy(), 2.0 * E)
    neox = transformers.GPTNeoXModel(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4))
    sct.spectral_conditioning(neox, lam=2.0, placement=placement)
    V = neox.layers[0].attention.query_key_value.parametrizations.weight[0].C  # 3D x D
    for j in range(3):  # rows of head h's q (j = 0), k (1), v (2): [24 h + 8 j, 24 h + 8 j + 8)
        rows = np.concatenate([np.arange(24 * h + 8 * j, 24 * h + 8 * j + 8) for h in range(4)])
        np.testing.assert_array_equal(V[rows].T.numpy(), 2.0 * E)
