"""Attention as trained models compute it (MATH.md §10): Q/K/V biases and RoPE in both pairings,
through the binding, against torch.func.jacrev of the Hugging Face formulas (rotate_half as in
transformers' apply_rotary_pos_emb, interleaved as in GPT-J's rotate_every_two) at small sizes."""

import numpy as np
import pytest

import spectral_cond as sc

torch = pytest.importorskip("torch")


def hf_attention(X, wq, wk, wv, bq, bk, bv, rope, c):
    """softmax(c q~ k~^T) v with q = X W_Q + b_Q etc. and RoPE written the way the Hugging Face
    and GPT-J code write it."""
    q, k, v = X @ wq, X @ wk, X @ wv
    if bq is not None:
        q = q + bq
    if bk is not None:
        k = k + bk
    if bv is not None:
        v = v + bv
    if rope is not None:
        N, d = q.shape
        rd = rope.dims or d
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        pos = torch.arange(N, dtype=torch.float64) + rope.offset
        freqs = torch.outer(pos, inv_freq)
        if rope.pairing == "rotate_half":
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()

            def rot(x):
                x1, x2 = x[:, : rd // 2], x[:, rd // 2:]
                return torch.cat((-x2, x1), dim=-1)
        else:
            cos = torch.repeat_interleave(freqs.cos(), 2, dim=-1)
            sin = torch.repeat_interleave(freqs.sin(), 2, dim=-1)

            def rot(x):
                return torch.stack((-x[:, 1::2], x[:, ::2]), dim=-1).flatten(-2)

        def apply(x):
            xr = x[:, :rd]
            return torch.cat((xr * cos + rot(xr) * sin, x[:, rd:]), dim=-1)

        q, k = apply(q), apply(k)
    return torch.softmax(c * q @ k.T, dim=-1) @ v


def column_major(jac, N, dv):
    """jacrev's (N, d_v, rows, cols) blocks in MATH.md §1's column-major vec convention."""
    out = []
    for j in jac:
        if j.dim() == 4:
            out.append(j.permute(1, 0, 3, 2).reshape(N * dv, -1).numpy())
        else:  # a bias: (N, d_v, k)
            out.append(j.permute(1, 0, 2).reshape(N * dv, -1).numpy())
    return np.hstack(out)


CASES = [
    ("biases", True, None),
    ("rotate_half", False, sc.Rope("rotate_half", theta=100.0, dims=4, offset=2)),
    ("interleaved", False, sc.Rope("interleaved", theta=10000.0)),
    ("biases+rotate_half", True, sc.Rope("rotate_half")),
    ("biases+interleaved", True, sc.Rope("interleaved", theta=50.0, offset=5)),
]


@pytest.mark.parametrize("name,biased,rope", CASES, ids=[c[0] for c in CASES])
def test_jacobian_against_jacrev_of_the_hugging_face_formula(name, biased, rope):
    rng = np.random.default_rng(7)
    N, D, dk, dv = 5, 7, 6, 3
    X = rng.standard_normal((N, D))
    WQ, WK = rng.standard_normal((D, dk)) * 0.6, rng.standard_normal((D, dk)) * 0.6
    WV = rng.standard_normal((D, dv)) * 0.4
    b = (rng.standard_normal(dk), rng.standard_normal(dk), rng.standard_normal(dv))
    biases = b if biased else None
    c = 1 / np.sqrt(dk)
    T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    Xt = T(X)
    tb = [T(v) for v in b] if biased else [None, None, None]

    def f(wq, wk, wv, bq, bk, bv):
        return hf_attention(Xt, wq, wk, wv, bq, bk, bv, rope, c)

    args = [T(WQ), T(WK), T(WV)] + [T(v) for v in b]
    A_ref = f(*args[:3], *tb).numpy()
    A = sc.attention(X, WQ, WK, WV, biases=biases, rope=rope)
    assert np.abs(A - A_ref).max() < 1e-13

    if biased:
        jac = torch.func.jacrev(f, argnums=(0, 1, 2, 3, 4, 5))(*args)
    else:
        jac = torch.func.jacrev(lambda wq, wk, wv: f(wq, wk, wv, None, None, None),
                                argnums=(0, 1, 2))(*args[:3])
    ref = column_major(jac, N, dv)
    J = sc.attention_jacobian(X, WQ, WK, WV, biases=biases, rope=rope)
    nW = J.shape[1]
    scale = np.abs(ref).max()
    assert np.abs(J - ref[:, :nW]).max() <= 1e-10 * scale
    Jb = sc.attention_jacobian(X, WQ, WK, WV, block="bias", biases=biases, rope=rope)
    if biased:
        assert np.abs(Jb - ref[:, nW:]).max() <= 1e-10 * scale
    key_bias = np.abs(Jb[:, dk:2 * dk]).max()
    if rope is None:
        assert key_bias == 0.0  # the exact null space of the key bias
    else:
        assert key_bias > 1e-3

    # The Gram matrix and the VJP's bias cotangents.
    G = sc.attention_gram(X, WQ, WK, WV, biases=biases, rope=rope)
    assert np.abs(G - J @ J.T).max() <= 1e-12 * np.abs(G).max()
    g = rng.standard_normal((N, dv))
    grads = sc.attention_vjp(X, WQ, WK, WV, g, biases=biases, rope=rope)
    gb = Jb.T @ g.reshape(-1, order="F")
    assert np.allclose(np.concatenate([grads.dbQ, grads.dbK, grads.dbV]), gb, rtol=0, atol=1e-12)


def random_block(seed, N, D, dk, dv):
    """X (N x D), W_Q, W_K, W_V scaled by 1/sqrt(D), and biases (b_Q, b_K, b_V)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    W = tuple(rng.standard_normal((D, w)) / np.sqrt(D) for w in (dk, dk, dv))
    b = (rng.standard_normal(dk), rng.standard_normal(dk), rng.standard_normal(dv))
    return X, W, b


def test_kappa_jacobian_with_biases_and_rope_agrees_with_the_svd():
    X, (WQ, WK, WV), b = random_block(3, 4, 12, 4, 4)
    rope = sc.Rope("interleaved")
    J = sc.attention_jacobian(X, WQ, WK, WV, biases=b, rope=rope)
    s = np.linalg.svd(J, compute_uv=False)
    for method in ("dense", "qr", "auto"):
        r = sc.kappa_jacobian(X, WQ, WK, WV, method=method, biases=b, rope=rope)
        assert r.rope == "interleaved" and r.biases
        assert abs(r.kappa - s[0] / s[-1]) <= 1e-9 * r.kappa
    Jwb = np.hstack([J, sc.attention_jacobian(X, WQ, WK, WV, block="bias", biases=b, rope=rope)])
    s2 = np.linalg.svd(Jwb, compute_uv=False)
    r = sc.kappa_jacobian(X, WQ, WK, WV, method="qr", biases=b, rope=rope, include_biases=True)
    assert r.include_biases
    assert abs(r.kappa - s2[0] / s2[-1]) <= 1e-9 * r.kappa


def test_theorem34_with_biases_and_rope_reports_the_bound_not_applicable():
    X, (WQ, WK, WV), b = random_block(5, 4, 8, 4, 3)
    plain = sc.theorem34(X, WQ, WK, WV)
    assert plain.bound_applies and np.isfinite(plain.bound_plus)
    r = sc.theorem34(X, WQ, WK, WV, biases=b, rope=sc.Rope("rotate_half"))
    assert not r.bound_applies
    assert np.isnan(r.bound) and np.isnan(r.bound_plus)
    assert not r.holds_plus and "not applicable" in r.verdict
    s = np.linalg.svd(sc.attention_jacobian(X, WQ, WK, WV, biases=b, rope=sc.Rope("rotate_half")),
                      compute_uv=False)
    assert abs(r.J.kappa - s[0] / s[-1]) <= 1e-9 * r.J.kappa
    assert r.free_bound_holds


def test_bad_biases_and_rope_are_named():
    rng = np.random.default_rng(1)
    X, W = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    with pytest.raises(ValueError, match="bias_q must have length 4"):
        sc.attention(X, W, W, W, biases=(np.ones(3), None, None))
    with pytest.raises(ValueError, match="bias_k must be a vector"):
        sc.attention(X, W, W, W, biases=(None, np.ones((2, 2)), None))
    with pytest.raises(TypeError, match="biases must be a tuple"):
        sc.attention(X, W, W, W, biases=np.ones(4))
    with pytest.raises(ValueError, match="rotate_half or interleaved"):
        sc.attention(X, W, W, W, rope="neox")
    with pytest.raises(ValueError, match="does not model RoPE"):
        sc.attention_jacobian(X, W, W, W, block="x", rope="rotate_half")


def test_analyze_model_uses_the_modules_biases_and_rope():
    """A Llama-shaped module (q/k/v_proj with biases, as Qwen2 has, given its RoPE angles as
    Hugging Face passes them, position_embeddings = (cos, sin)): analyze_model's kappa(J) per
    head is that of jacrev of the HF formula. Explicit angle tables through the binding too."""
    import spectral_cond.torch as sct
    from torch import nn

    rope = sc.Rope("rotate_half", theta=500.0)
    N, H, d = 6, 2, 4
    inv = 1.0 / (500.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(N, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], 1).cos(), torch.cat([ang, ang], 1).sin()

    def rot(t):
        return torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = H, d
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))

        def forward(self, hidden_states, position_embeddings):
            c, s_ = position_embeddings
            B = hidden_states.shape[0]
            sp = lambda t: t.view(B, N, H, d).transpose(1, 2)
            q, k, v = (sp(f(hidden_states)) for f in (self.q_proj, self.k_proj, self.v_proj))
            q, k = q * c + rot(q) * s_, k * c + rot(k) * s_
            p = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1)
            return (p @ v).transpose(1, 2).reshape(B, N, H * d)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x):
            return self.attn(x, position_embeddings=(cos[None], sin[None]))

    torch.manual_seed(0)
    model = Model().double()
    x = torch.randn(1, N, 8, dtype=torch.float64)
    res = sct.analyze_model(model, x)
    m = model.attn
    X = x[0]
    for r in res:
        h = r.head
        sl = slice(4 * h, 4 * h + 4)
        w = [lin.weight.detach()[sl].T for lin in (m.q_proj, m.k_proj, m.v_proj)]
        b = [lin.bias.detach()[sl] for lin in (m.q_proj, m.k_proj, m.v_proj)]
        jac = torch.func.jacrev(
            lambda wq, wk, wv: hf_attention(X, wq, wk, wv, *b, rope, 0.5), argnums=(0, 1, 2))(*w)
        s = np.linalg.svd(column_major(jac, 6, 4), compute_uv=False)
        assert r.info == "success" and r.verify_error <= 1e-12, r.note
        assert r.rope and r.has_bias and "biases and RoPE" in r.note
        assert r.kappa_J == pytest.approx(s[0] / s[-1], rel=1e-9)
        # The same through explicit tables: the binding's Rope(cos=, sin=).
        wq, wk, wv = (t.numpy() for t in w)
        tab = sc.Rope("rotate_half", cos=cos.numpy(), sin=sin.numpy())
        k = sc.kappa_jacobian(X.numpy(), wq, wk, wv, scale=0.5, biases=tuple(t.numpy() for t in b),
                              rope=tab, method="dense")
        assert k.kappa == pytest.approx(s[0] / s[-1], rel=1e-9)


def test_rope_tables_are_checked():
    X = np.random.default_rng(2).standard_normal((5, 4))
    W = np.random.default_rng(3).standard_normal((4, 4))
    with pytest.raises(ValueError, match="one row per token, N = 5"):
        sc.attention(X, W, W, W, rope=sc.Rope(cos=np.ones((4, 4)), sin=np.zeros((4, 4))))
    with pytest.raises(ValueError, match="same shape"):
        sc.attention(X, W, W, W, rope=sc.Rope(cos=np.ones((5, 4)), sin=np.zeros((5, 2))))
    with pytest.raises(ValueError, match="given together"):
        sc.attention(X, W, W, W, rope=sc.Rope(cos=np.ones((5, 4))))
    # Identity tables (cos 1, sin 0) are no rotation at all.
    A = sc.attention(X, W, W, W, rope=sc.Rope(cos=np.ones((5, 4)), sin=np.zeros((5, 4))))
    np.testing.assert_allclose(A, sc.attention(X, W, W, W), rtol=0, atol=1e-15)
