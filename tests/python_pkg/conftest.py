"""Shared helpers of the spectral_cond Python package tests (references are numpy and torch)."""

import numpy as np
import pytest

EPS = np.finfo(np.float64).eps


@pytest.fixture
def rng():
    return np.random.default_rng(20251201)


def instance(rng, N=5, D=4, dk=3, dv=2, order="F", dtype=np.float64, wscale=0.7):
    """X (N x D), W_Q, W_K (D x dk), W_V (D x dv), in the given memory order."""
    X = rng.standard_normal((N, D))
    WQ = wscale * rng.standard_normal((D, dk))
    WK = wscale * rng.standard_normal((D, dk))
    WV = wscale * rng.standard_normal((D, dv))
    return tuple(np.array(a, dtype=dtype, order=order) for a in (X, WQ, WK, WV))


def np_attention(X, WQ, WK, WV, scale=None, mask=None):
    """A = softmax(c Q K^T + M) V in numpy (MATH.md §1)."""
    c = 1 / np.sqrt(WQ.shape[1]) if scale is None else scale
    Q, K, V = X @ WQ, X @ WK, X @ WV
    Z = c * Q @ K.T
    if isinstance(mask, str) and mask == "causal":
        Z = Z + np.triu(np.full(Z.shape, -np.inf), 1)
    elif isinstance(mask, np.ndarray):
        Z = Z + mask
    Z = Z - Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    P /= P.sum(axis=1, keepdims=True)
    return P @ V


def torch_jacobian(X, WQ, WK, WV, scale=None, causal=False, biases=None):
    """J by torch.func.jacrev, in MATH.md §1's column-major convention: row i + N q for A[i, q],
    column a + D b for W[a, b], blocks [W_Q | W_K | W_V]; `biases` (b_Q, b_K, b_V) are added to
    Q, K, V (MATH.md §10)."""
    import torch

    Xt = torch.tensor(X, dtype=torch.float64)
    N, D = X.shape
    dk, dv = WQ.shape[1], WV.shape[1]
    c = 1 / np.sqrt(dk) if scale is None else scale

    bq, bk, bv = ([0.0] * 3 if biases is None else
                  [torch.tensor(b, dtype=torch.float64) for b in biases])

    def f(wq, wk, wv):
        Z = c * (Xt @ wq + bq) @ (Xt @ wk + bk).T
        if causal:
            Z = Z + torch.triu(torch.full((N, N), float("-inf"), dtype=torch.float64), 1)
        return torch.softmax(Z, dim=1) @ (Xt @ wv + bv)

    ws = [torch.tensor(w, dtype=torch.float64) for w in (WQ, WK, WV)]
    jac = torch.func.jacrev(f, argnums=(0, 1, 2))(*ws)
    blocks = [j.permute(1, 0, 3, 2).reshape(N * dv, -1).numpy() for j in jac]
    return np.hstack(blocks)


# Two attention layouts as the model zoo writes them, for the tests of spectral_cond.torch.
import math  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


class TimmAttention(nn.Module):
    """timm's Attention layout: one qkv Linear (3 D x D, rows Q, K, V), num_heads, scale."""

    def __init__(self, dim, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class HFSelfAttention(nn.Module):
    """Hugging Face BERT's layout: query, key, value Linears and num_attention_heads."""

    def __init__(self, dim, heads, bias=True):
        super().__init__()
        self.num_attention_heads = heads
        self.attention_head_size = dim // heads
        self.query = nn.Linear(dim, dim, bias=bias)
        self.key = nn.Linear(dim, dim, bias=bias)
        self.value = nn.Linear(dim, dim, bias=bias)

    def forward(self, hidden_states):
        B, N, D = hidden_states.shape
        h, d = self.num_attention_heads, self.attention_head_size
        split = lambda t: t.view(B, N, h, d).transpose(1, 2)
        q, k, v = (split(f(hidden_states)) for f in (self.query, self.key, self.value))
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        return (p @ v).transpose(1, 2).reshape(B, N, D)
