"""An independent float64 reference for κ(J) of one head of a real model's attention: the test
rewrites the module's attention (projections, biases, the logit scale, the mask, RoPE, a logit
bias) in torch with float64, differentiates it with torch.func.jacrev and takes numpy's SVD.
Nothing here calls spectral_cond. Each model test also checks that its rewrite reproduces the
module's own output, so the reference is the module's function."""

import numpy as np
import torch

EPS = np.finfo(np.float64).eps


def rope_tables(N, rot, theta, factor=1.0, pairing="rotate_half", positions=None):
    """cos, sin (N x rot, float64) of RoPE with angles position x theta^(-2j/rot) / factor."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot) / factor
    pos = torch.arange(N, dtype=torch.float64) if positions is None else positions.double()
    ang = pos[:, None] * inv[None, :]
    if pairing == "rotate_half":
        ang = torch.cat([ang, ang], 1)
    else:
        ang = torch.repeat_interleave(ang, 2, 1)
    return ang.cos(), ang.sin()


def rotate(t, cos, sin, pairing="rotate_half"):
    """t (N x d) with its first cos.shape[1] columns rotated, as Hugging Face (rotate_half) and
    GPT-J (interleaved) write it."""
    r = cos.shape[1]
    x = t[:, :r]
    if pairing == "rotate_half":
        turned = torch.cat([-x[:, r // 2:], x[:, :r // 2]], 1)
    else:
        turned = torch.stack([-x[:, 1::2], x[:, 0::2]], -1).flatten(-2)
    return torch.cat([x * cos + turned * sin, t[:, r:]], 1)


class Head:
    """One head's attention as a function of (W_Q, W_K, W_V), D x d each, float64."""

    def __init__(self, X, scale, bq=None, bk=None, bv=None, mask=None, rope=None,
                 pairing="rotate_half", zero_rows=None):
        self.X = torch.as_tensor(np.asarray(X), dtype=torch.float64)
        self.scale = scale
        self.b = [None if b is None else torch.as_tensor(np.asarray(b), dtype=torch.float64)
                  for b in (bq, bk, bv)]
        self.mask = None if mask is None else torch.as_tensor(np.asarray(mask), dtype=torch.float64)
        self.rope = rope
        self.pairing = pairing
        self.zero_rows = zero_rows  # rows the module outputs as 0 (no key to attend to)

    def __call__(self, wq, wk, wv):
        q, k, v = self.X @ wq, self.X @ wk, self.X @ wv
        q = q if self.b[0] is None else q + self.b[0]
        k = k if self.b[1] is None else k + self.b[1]
        v = v if self.b[2] is None else v + self.b[2]
        if self.rope is not None:
            q = rotate(q, *self.rope, self.pairing)
            k = rotate(k, *self.rope, self.pairing)
        Z = self.scale * q @ k.T
        if self.mask is not None:
            M = self.mask
            if self.zero_rows is not None:
                M = M.clone()
                M[self.zero_rows] = 0.0
            Z = Z + M
        A = torch.softmax(Z, 1) @ v
        if self.zero_rows is not None:
            A = A.clone()
            A[self.zero_rows] = 0.0
        return A

    def output(self, wq, wk, wv):
        t = [torch.as_tensor(np.asarray(w), dtype=torch.float64) for w in (wq, wk, wv)]
        return self(*t).numpy()

    def kappa(self, wq, wk, wv):
        """(κ(J), singular values) of J = d vec(A) / d (W_Q, W_K, W_V); +inf where σ_min is at
        rounding level (below max(m, n) ε σ_1)."""
        t = [torch.as_tensor(np.asarray(w), dtype=torch.float64) for w in (wq, wk, wv)]
        jac = torch.func.jacrev(self, argnums=(0, 1, 2))(*t)
        rows = t[2].shape[1] * self.X.shape[0]
        J = np.hstack([j.reshape(rows, -1).numpy() for j in jac])
        s = np.linalg.svd(J, compute_uv=False)
        if s[-1] <= max(J.shape) * EPS * s[0]:
            return float("inf"), s
        return float(s[0] / s[-1]), s


def check_head(r, kappa_ref, s):
    """A result within its stated accuracy of the reference (the reference's own error, about
    ε κ, added), or +inf where the reference finds J singular."""
    if np.isinf(kappa_ref):
        assert r.info == "singular" and np.isinf(r.kappa_J), (r.info, r.kappa_J, r.note)
        return
    assert r.info == "success", (r.info, r.note)
    allowed = 2 * r.accuracy + 100 * EPS * kappa_ref
    assert abs(r.kappa_J - kappa_ref) <= allowed * kappa_ref, (r.kappa_J, kappa_ref, r.accuracy)
