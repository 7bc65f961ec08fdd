#!/usr/bin/env python3
"""`spectral-cond analyze --jacobian` with the checkpoint's Q/K/V biases and RoPE (MATH.md §10),
against an independent numpy reference: J by the complex step (exact to rounding: attention is
analytic in W), the forward written the way the Hugging Face code writes it (rotate_half as in
apply_rotary_pos_emb, interleaved as GPT-J's rotate_every_two), and numpy's SVD.

* Qwen2-like (Llama layout, grouped-query heads, q/k/v biases, rope_theta), Phi-like (partial
  rotary), GPT-NeoX (packed per-head q/k/v with a packed bias, rotary_pct, rotary_emb_base),
  GPT-2 (Conv1D c_attn and c_attn.bias, no RoPE), --rope interleaved on a Llama checkpoint;
* the JSON says which biases and which RoPE were used, and that Theorem 3.4 does not apply;
  --no-biases --rope none gives the block of the weights alone, where it does;
* an all-zero bias is listed and left out; refusals (no config.json for Llama-named tensors,
  rope_scaling, options without --jacobian) exit 2 with one line naming the reason.

Run by ctest:  python test_cli_bias_rope.py --exe spectral-cond
"""
import csv
import io
import json
import os
import sys
import tempfile
import unittest

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The tool's runner, analyze --format json and the --exe command line, shared with the
# checkpoint tests (their main() sets the tool's path and runs this file's tests).
from test_cli_checkpoints import analyze_json, main, run  # noqa: E402

SEED = 20261202


def rope_tables(N, d, pairing, theta, dims):
    """cos and sin (N x dims) and the rotation x -> rot(x) of the rotated columns (last axis)."""
    rd = dims or d
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    f = np.outer(np.arange(N), inv)
    if pairing == "rotate_half":
        cos, sin = np.cos(np.hstack([f, f])), np.sin(np.hstack([f, f]))

        def rot(x):
            return np.concatenate([-x[..., rd // 2:], x[..., :rd // 2]], axis=-1)
    else:
        cos, sin = np.repeat(np.cos(f), 2, axis=1), np.repeat(np.sin(f), 2, axis=1)

        def rot(x):
            out = np.empty_like(x)
            out[..., ::2], out[..., 1::2] = -x[..., 1::2], x[..., ::2]
            return out
    return rd, cos, sin, rot


def attention_qkv(q, k, v, c, rope=None, causal=False):
    """softmax(c q~ k~^T + M) v from the biased q, k, v (..., N, d), RoPE written as Hugging Face
    (rotate_half) and GPT-J (interleaved) write it, M causal or 0; complex-safe (no conjugation,
    no max subtraction), batched over leading axes."""
    if rope is not None:
        rd, cos, sin, rot = rope_tables(q.shape[-2], q.shape[-1], *rope)

        def apply(x):
            xr = x[..., :rd]
            return np.concatenate([xr * cos + rot(xr) * sin, x[..., rd:]], axis=-1)
        q, k = apply(q), apply(k)
    E = np.exp(c * (q @ np.swapaxes(k, -1, -2)))
    if causal:  # exp(-inf) = 0 above the diagonal
        N = E.shape[-1]
        E = np.where(np.tril(np.ones((N, N), dtype=bool)), E, 0)
    return (E / E.sum(axis=-1, keepdims=True)) @ v


def jacobian(X, WQ, WK, WV, bq=None, bk=None, bv=None, rope=None, c=None, causal=False):
    """J = d vec(A) / d [vec W_Q, vec W_K, vec W_V] (column-major vec, MATH.md §1) by the complex
    step, exact to rounding (attention is analytic in W), batched over J's columns: W[a, b] +=
    i h moves column b of X W by i h x_a, so the columns a + D b of a block come from one batch."""
    h = 1e-30
    N, D = X.shape
    c = 1 / np.sqrt(WQ.shape[1]) if c is None else c
    M = [X @ W + (0 if b is None else b) for W, b in ((WQ, bq), (WK, bk), (WV, bv))]
    blocks = []
    for which in range(3):
        cols = []
        for b in range(M[which].shape[1]):
            P = np.broadcast_to(M[which].astype(complex), (D, N, M[which].shape[1])).copy()
            P[:, :, b] += 1j * h * X.T
            qkv = [P if w == which else M[w][None] for w in range(3)]
            A = attention_qkv(*qkv, c, rope, causal)
            cols.append((A.imag / h).transpose(0, 2, 1).reshape(D, -1))  # vec(A) column-major
        blocks.append(np.concatenate(cols, axis=0))
    return np.concatenate(blocks, axis=0).T


def kappa(J):
    s = np.linalg.svd(J, compute_uv=False)
    return s[0] / s[-1]


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def path(self, *parts):
        p = os.path.join(self.dir, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def save(self, sub, tensors, config=None, X=None):
        p = self.path(sub, "model.safetensors")
        save_file(tensors, p)
        if config is not None:
            with open(self.path(sub, "config.json"), "w") as f:
                json.dump(config, f)
        xp = None
        if X is not None:
            xp = self.path(sub, "X.npy")
            np.save(xp, X)
        return p, xp

    def check_heads(self, L, X, heads, kv_heads, d, WQ, WK, WV, bq, bk, bv, rope, tol=1e-9,
                    causal=True):
        """Every head's kappa(J) against the reference, with the head's slices of W and b. The
        models here are decoders: --mask auto makes their self-attention causal."""
        group = heads // kv_heads
        self.assertEqual(len(L["jacobian"]), heads)
        self.assertEqual(L["mask"], "causal" if causal else "none")
        for J in L["jacobian"]:
            h = J["head"]
            g = h // group
            sq, sk = slice(h * d, (h + 1) * d), slice(g * d, (g + 1) * d)
            ref = kappa(jacobian(X, WQ[:, sq], WK[:, sk], WV[:, sk],
                                 None if bq is None else bq[sq], None if bk is None else bk[sk],
                                 None if bv is None else bv[sk], rope, causal=causal))
            got = float(J["J"]["kappa"])
            with self.subTest(head=h):
                self.assertLessEqual(abs(got - ref), tol * ref, f"head {h}: {got} vs {ref}")
                th = J["theorem34"]
                extended = any(b is not None for b in (bq, bk, bv)) or rope is not None
                self.assertEqual(th["applies"], not extended)
                if extended:
                    self.assertEqual(th["bound_plus"], "nan")
                    self.assertFalse(th["holds_plus"])
                    self.assertIn("not applicable", th["verdict"])
                else:
                    self.assertNotEqual(th["bound_plus"], "nan")
                self.assertTrue(J["bound_free"]["holds"])


def llama_tensors(rng, D, heads, kv_heads, d, biases, prefix="model.layers.0.self_attn."):
    t, W, b = {}, [], []
    for n, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
        T = rng.standard_normal((rows, D)) * 0.4
        t[f"{prefix}{n}_proj.weight"] = T
        W.append(T.T)
        if biases:
            bb = rng.standard_normal(rows) * 0.5
            t[f"{prefix}{n}_proj.bias"] = bb
            b.append(bb)
        else:
            b.append(None)
    t["model.layers.0.mlp.up_proj.weight"] = rng.standard_normal((2 * D, D))
    return t, W, b


class TestModels(Base):
    def test_qwen2_gqa_biases_and_rope(self):
        rng = np.random.default_rng(SEED)
        D, H, G, d, N = 8, 4, 2, 2, 5
        t, W, b = llama_tensors(rng, D, H, G, d, True)
        cfg = {"model_type": "qwen2", "num_attention_heads": H, "num_key_value_heads": G,
               "hidden_size": D, "rope_theta": 50.0}
        X = rng.standard_normal((N, D))
        p, xp = self.save("qwen2", t, cfg, X)
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertEqual(rep["format_version"], 2)
        self.assertEqual(L["biases"]["b_Q"], "model.layers.0.self_attn.q_proj.bias")
        self.assertEqual(L["biases"]["zero"], [])
        self.assertEqual(L["rope"]["pairing"], "rotate_half")
        self.assertEqual(L["rope"]["theta"], 50.0)
        self.assertEqual(L["rope"]["dims"], d)
        self.assertIn("model_type qwen2", L["rope"]["source"])
        self.check_heads(L, X, H, G, d, *W, *b, ("rotate_half", 50.0, 0))
        # The weights alone: the bound applies again, and kappa(J) is that block's.
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections", "--no-biases", "--rope", "none")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertIsNone(L["rope"])
        self.assertIsNone(L["biases"]["b_Q"])
        self.check_heads(L, X, H, G, d, *W, None, None, None, None)
        # Table and CSV say n/a where the bound does not apply.
        r = run("analyze", p, "--jacobian", "--inputs", xp, "--no-jacobian-corrections",
                "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("n/a", r.stdout)
        self.assertIn("with biases b_Q, b_K, b_V and RoPE rotate_half (theta 50", r.stdout)
        r = run("analyze", p, "--jacobian", "--inputs", xp, "--no-jacobian-corrections",
                "--format", "csv", "--quiet")
        rows = list(csv.reader(io.StringIO(r.stdout)))
        col = rows[0].index("holds_plus")
        self.assertEqual({x[col] for x in rows[1:] if x[4] == "J"}, {"n/a"})

    def test_phi_partial_rotary_and_interleaved_override(self):
        rng = np.random.default_rng(SEED + 1)
        D, H, d, N = 8, 2, 4, 6
        t, W, b = llama_tensors(rng, D, H, H, d, False)
        cfg = {"model_type": "phi", "num_attention_heads": H, "hidden_size": D,
               "rope_theta": 100.0, "partial_rotary_factor": 0.5}
        X = rng.standard_normal((N, D))
        p, xp = self.save("phi", t, cfg, X)
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertEqual(L["rope"]["dims"], 2)
        self.assertEqual(L["biases"], {"b_Q": None, "b_K": None, "b_V": None, "zero": []})
        self.check_heads(L, X, H, H, d, *W, *b, ("rotate_half", 100.0, 2))
        # --rope interleaved --rope-theta --rope-dims override the config.
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections", "--rope", "interleaved",
                           "--rope-theta", 30, "--rope-dims", 4)
        L = rep["checkpoints"][0]["layers"][0]
        self.assertEqual(L["rope"]["pairing"], "interleaved")
        self.assertIn("--rope interleaved", L["rope"]["source"])
        self.check_heads(L, X, H, H, d, *W, *b, ("interleaved", 30.0, 0))

    def test_gpt_neox_packed_bias_and_rotary_pct(self):
        rng = np.random.default_rng(SEED + 2)
        D, H, d, N = 8, 2, 4, 5
        T = rng.standard_normal((3 * D, D)) * 0.4
        B = rng.standard_normal(3 * D) * 0.5
        name = "gpt_neox.layers.0.attention.query_key_value."
        t = {name + "weight": T, name + "bias": B,
             "gpt_neox.layers.0.mlp.dense_h_to_4h.weight": rng.standard_normal((2 * D, D))}
        cfg = {"model_type": "gpt_neox", "num_attention_heads": H, "hidden_size": D,
               "rotary_pct": 0.5, "rotary_emb_base": 40}
        X = rng.standard_normal((N, D))
        p, xp = self.save("neox", t, cfg, X)
        # Per head: rows [q_h; k_h; v_h] of d each.
        G = T.reshape(H, 3, d, D)
        Bg = B.reshape(H, 3, d)
        W = [np.concatenate([G[h, j].T for h in range(H)], axis=1) for j in range(3)]
        b = [np.concatenate([Bg[h, j] for h in range(H)]) for j in range(3)]
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertEqual(L["rope"]["dims"], 2)
        self.assertEqual(L["rope"]["theta"], 40.0)
        self.check_heads(L, X, H, H, d, *W, *b, ("rotate_half", 40.0, 2))

    def test_gpt2_conv1d_bias_and_an_all_zero_bias(self):
        rng = np.random.default_rng(SEED + 3)
        D, H, d, N = 8, 2, 4, 6
        T = rng.standard_normal((D, 3 * D)) * 0.4  # Conv1D: x @ T
        B = rng.standard_normal(3 * D) * 0.5
        t = {"h.0.attn.c_attn.weight": T, "h.0.attn.c_attn.bias": B}
        cfg = {"model_type": "gpt2", "n_head": H, "n_embd": D}
        X = rng.standard_normal((N, D))
        p, xp = self.save("gpt2", t, cfg, X)
        W = [T[:, j * D:(j + 1) * D] for j in range(3)]
        b = [B[j * D:(j + 1) * D] for j in range(3)]
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertIsNone(L["rope"])
        self.assertIn("model_type gpt2", L["rope_source"])
        self.check_heads(L, X, H, H, d, *W, *b, None)
        # An all-zero bias is listed and left out: the block is the one without biases.
        t["h.0.attn.c_attn.bias"] = np.zeros(3 * D)
        p, _ = self.save("gpt2", t, cfg)
        rep = analyze_json(p, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--no-jacobian-corrections")
        L = rep["checkpoints"][0]["layers"][0]
        self.assertEqual(L["biases"]["zero"], ["b_Q", "b_K", "b_V"])
        self.check_heads(L, X, H, H, d, *W, None, None, None, None)


class TestRefusals(Base):
    def refused(self, *args, says):
        r = run("analyze", *args, "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn(says, r.stderr)
        self.assertEqual(r.stdout, "")

    def test_refusals(self):
        rng = np.random.default_rng(SEED + 4)
        t, _, _ = llama_tensors(rng, 8, 2, 2, 4, True)
        p, _ = self.save("nocfg", t)
        # Llama-named tensors and no config.json: whether there is RoPE is unknown.
        self.refused(p, "--heads", 2, "--jacobian", "--tokens", 4,
                     says="no config.json says whether the llama layers rotate")
        self.assertEqual(run("analyze", p, "--heads", 2, "--jacobian", "--tokens", 4,
                             "--rope", "rotate_half", "--quiet").returncode, 0)
        self.assertEqual(run("analyze", p, "--heads", 2, "--jacobian", "--tokens", 4,
                             "--rope", "none", "--quiet").returncode, 0)
        # ... which matters only for --jacobian.
        self.assertEqual(run("analyze", p, "--heads", 2, "--quiet").returncode, 0)
        for opt in (["--no-biases"], ["--rope", "none"], ["--rope-theta", 5],
                    ["--rope-dims", 2]):
            self.refused(p, "--heads", 2, *opt, says=f"{opt[0]} needs --jacobian")
        self.refused(p, "--heads", 2, "--jacobian", "--rope", "none", "--rope-theta", 5,
                     says="--rope-theta and --rope-dims need RoPE")
        self.refused(p, "--heads", 2, "--jacobian", "--rope", "rotate_half", "--rope-dims", 3,
                     says="rotated width 3 is not even")
        # Scaled RoPE is refused, not approximated.
        p, _ = self.save("scaled", t, {"model_type": "llama", "num_attention_heads": 2,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2}})
        self.refused(p, "--jacobian", "--tokens", 4, says="rope_scaling linear is not modelled")


if __name__ == "__main__":
    main()
