#!/usr/bin/env python3
"""The attention diagnostics (MATH.md §11), the bound without hypothesis (MATH.md §5) and kappa(J)
before and after the corrections, through the CLI, against numpy:

* `kappa` (with and without --bound): the attention pattern of P, the block norms and
  sigma_max(J) / sigma_N(P X) against J assembled in numpy from the column formulas of MATH.md §3
  and numpy.linalg.svd; the bound is >= kappa(J);
* `analyze --jacobian --inputs X.npy --method dense`: kappa(J) after lambda I_k (fused and per-head
  placements) and after the exact correction, against numpy on the corrected weights;
* the demo checkpoint: `analyze DIR --lambda 10 --jacobian` shows the collapse on layer 0
  (kappa(J) after = kappa(X) = 3.666, every row of P one-hot on the diagonal) and says so;
* `verify`: the bound without hypothesis is checked as a proven statement (never violated), and
  every regime reports kappa(J) before and after lambda.

Run by ctest:  python test_cli_diagnostics.py --exe spectral-cond
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

EXE = None
TIMEOUT = 900


def run(*args, timeout=TIMEOUT):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def run_json(*args):
    r = run(*args, "--format", "json", "--quiet")
    if r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


def num(x):
    return float(x)


def softmax_rows(Z):
    Z = Z - Z.max(axis=1, keepdims=True)
    E = np.exp(Z)
    return E / E.sum(axis=1, keepdims=True)


def attention_jacobian(X, WQ, WK, WV, c, causal=False):
    """J = [J_Q | J_K | J_V] (column-major vecs) from the column formulas of MATH.md §3."""
    N, D = X.shape
    dk, dv = WQ.shape[1], WV.shape[1]
    Q, K, V = X @ WQ, X @ WK, X @ WV
    Z = c * Q @ K.T
    if causal:
        Z = Z + np.triu(np.full((N, N), -np.inf), 1)
    P = softmax_rows(Z)
    A = P @ V

    def R(w):
        return P @ (w[:, None] * V) - (P @ w)[:, None] * A

    def vec(M):
        return M.flatten(order="F")

    JQ = np.zeros((N * dv, D * dk))
    JK = np.zeros((N * dv, D * dk))
    JV = np.zeros((N * dv, D * dv))
    for b in range(dk):
        Rk = R(K[:, b])
        for a in range(D):
            JQ[:, a + D * b] = c * vec(X[:, a][:, None] * Rk)
            JK[:, a + D * b] = c * vec(Q[:, b][:, None] * R(X[:, a]))
    for b in range(dv):
        for a in range(D):
            M = np.zeros((N, dv))
            M[:, b] = P @ X[:, a]
            JV[:, a + D * b] = vec(M)
    return P, JQ, JK, JV


def layer_norm_rows(X):
    X = X - X.mean(axis=1, keepdims=True)
    return X / np.sqrt((X ** 2).mean(axis=1, keepdims=True))


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def save(self, name, a):
        p = os.path.join(self.dir, name)
        np.save(p, a)
        return p


class TestKappa(Base):
    def check_against_numpy(self, X, WQ, WK, WV, causal, out):
        c = 1 / np.sqrt(WQ.shape[1])
        P, JQ, JK, JV = attention_jacobian(X, WQ, WK, WV, c, causal)
        J = np.hstack([JQ, JK, JV])
        s = np.linalg.svd(J, compute_uv=False)
        self.assertAlmostEqual(num(out["kappa"]) / (s[0] / s[-1]), 1, delta=1e-8)
        a = out["attention"]
        m = P.max(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            H = -np.where(P > 0, P * np.log(P), 0).sum(axis=1)
        self.assertAlmostEqual(num(a["row_max_min"]), m.min(), delta=1e-14)
        self.assertAlmostEqual(num(a["row_max_mean"]), m.mean(), delta=1e-14)
        self.assertAlmostEqual(num(a["entropy_mean"]), H.mean(), delta=1e-12)
        # Rows whose mask leaves one key (row 0 of a causal mask) are "forced", not saturated.
        forced = np.zeros(P.shape[0], dtype=bool)
        if causal:
            forced[0] = True
        self.assertEqual(a["forced_rows"], int(forced.sum()))
        sat = (m > 1 - 1e-6) & ~forced
        self.assertEqual(a["saturated_rows"], int(sat.sum()))
        self.assertAlmostEqual(num(a["saturated_fraction"]), sat.sum() / (~forced).sum(),
                               delta=1e-15)
        diag = sat & (P.argmax(axis=1) == np.arange(P.shape[0]))
        self.assertEqual(a["saturated_diagonal"], int(diag.sum()))
        self.assertEqual(a["norm"], "spectral")
        nq = np.linalg.norm(JQ, 2)
        nk = np.linalg.norm(JK, 2)
        nqk = np.linalg.norm(np.hstack([JQ, JK]), 2)
        nv = np.linalg.norm(JV, 2)
        self.assertAlmostEqual(num(a["sigma_max_JQ"]) / nq, 1, delta=1e-6)
        self.assertAlmostEqual(num(a["sigma_max_JK"]) / nk, 1, delta=1e-6)
        self.assertAlmostEqual(num(a["sigma_max_JQK"]) / nqk, 1, delta=1e-6)
        self.assertAlmostEqual(num(a["sigma_max_JV"]) / nv, 1, delta=1e-12)
        self.assertAlmostEqual(num(a["ratio_QK_V"]) / (nqk / nv), 1, delta=1e-6)
        return P, s

    def test_kappa_bound_free(self):
        rng = np.random.default_rng(7)
        for N, D, dk, dv, causal in [(5, 8, 3, 2, False), (6, 6, 2, 3, True), (4, 10, 4, 4, False)]:
            with self.subTest(N=N, D=D, causal=causal):
                X = rng.standard_normal((N, D))
                WQ, WK = rng.standard_normal((D, dk)) * 0.5, rng.standard_normal((D, dk)) * 0.5
                WV = rng.standard_normal((D, dv)) * 0.5
                files = [self.save(n, a) for n, a in
                         [("X.npy", X), ("WQ.npy", WQ), ("WK.npy", WK), ("WV.npy", WV)]]
                args = ["kappa", "--x", files[0], "--wq", files[1], "--wk", files[2], "--wv",
                        files[3], "--method", "dense", "--mask", "causal" if causal else "none"]
                plain = run_json(*args)
                self.assertNotIn("bound_free", plain)
                self.check_against_numpy(X, WQ, WK, WV, causal, plain)
                out = run_json(*args, "--bound")
                P, s = self.check_against_numpy(X, WQ, WK, WV, causal, out)
                b = out["bound_free"]
                sp = np.linalg.svd(P @ X, compute_uv=False)
                self.assertTrue(b["applicable"])
                self.assertAlmostEqual(num(b["sigma_max_J"]) / s[0], 1, delta=1e-9)
                self.assertAlmostEqual(num(b["sigma_N_PX"]) / sp[N - 1], 1, delta=1e-12)
                self.assertAlmostEqual(num(b["bound"]) / (s[0] / sp[N - 1]), 1, delta=1e-8)
                self.assertGreaterEqual(num(b["bound"]) * (1 + 1e-10), s[0] / s[-1])
                self.assertTrue(b["holds"])
                r = run(*args, "--bound", "--quiet")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIn("sigma_max(J) / sigma_N(P X)", r.stdout)
                self.assertIn("Attention pattern", r.stdout)

    def test_bound_free_vacuous_for_tall_x(self):
        rng = np.random.default_rng(8)
        X = rng.standard_normal((7, 4))
        W = rng.standard_normal((4, 2))
        f = [self.save(n, a) for n, a in [("X.npy", X), ("W.npy", W)]]
        out = run_json("kappa", "--x", f[0], "--wq", f[1], "--wk", f[1], "--wv", f[1], "--bound")
        self.assertFalse(out["bound_free"]["applicable"])
        self.assertEqual(out["bound_free"]["bound"], "inf")


def write_hf_bert(path, rng, D, heads, layers=1):
    from safetensors.numpy import save_file
    t = {}
    for i in range(layers):
        p = f"encoder.layer.{i}.attention.self."
        for n in ("query", "key", "value"):
            t[p + n + ".weight"] = (rng.standard_normal((D, D)) * 0.3).astype(np.float64)
    save_file(t, path)
    return t


class TestAnalyzeCorrections(Base):
    def test_corrected_kappa_against_numpy(self):
        rng = np.random.default_rng(11)
        D, H, N, lam = 8, 2, 5, 0.7
        d = D // H
        ck = os.path.join(self.dir, "model.safetensors")
        t = write_hf_bert(ck, rng, D, H)
        X = layer_norm_rows(rng.standard_normal((N, D)))
        xp = self.save("X.npy", X)
        rep = run_json("analyze", ck, "--heads", H, "--jacobian", "--inputs", xp, "--method",
                       "dense", "--lambda", lam)
        L = rep["checkpoints"][0]["layers"][0]
        W = {r: t[f"encoder.layer.0.attention.self.{n}.weight"].T
             for r, n in [("q", "query"), ("k", "key"), ("v", "value")]}

        def exact(Wm):
            U, s, Vt = np.linalg.svd(Wm, full_matrices=False)
            return Wm + s[0] * U @ Vt

        for j in L["jacobian"]:
            h = j["head"]
            cols = slice(h * d, (h + 1) * d)
            variants = {
                "lambda_fused": {r: (W[r] + lam * np.eye(D, D))[:, cols] for r in W},
                "lambda_per_head": {r: W[r][:, cols] + lam * np.eye(D, d) for r in W},
                "exact": {r: exact(W[r])[:, cols] for r in W},
            }
            orig = {r: W[r][:, cols] for r in W}
            for name, w in [("original", orig), *variants.items()]:
                with self.subTest(head=h, correction=name):
                    e = j if name == "original" else j["corrected"][name]
                    P, JQ, JK, JV = attention_jacobian(X, w["q"], w["k"], w["v"], 1 / np.sqrt(d))
                    s = np.linalg.svd(np.hstack([JQ, JK, JV]), compute_uv=False)
                    self.assertAlmostEqual(num(e["J"]["kappa"]) / (s[0] / s[-1]), 1, delta=1e-8)
                    sp = np.linalg.svd(P @ X, compute_uv=False)
                    self.assertAlmostEqual(num(e["bound_free"]["bound"]) / (s[0] / sp[-1]), 1,
                                           delta=1e-8)
                    self.assertTrue(e["bound_free"]["holds"])
                    self.assertAlmostEqual(num(e["attention"]["row_max_mean"]),
                                           P.max(axis=1).mean(), delta=1e-13)
        # lambda = 0: the lambda variants are the original weights
        z = run_json("analyze", ck, "--heads", H, "--jacobian", "--inputs", xp, "--method",
                     "dense", "--lambda", 0)
        for j in z["checkpoints"][0]["layers"][0]["jacobian"]:
            for name in ("lambda_fused", "lambda_per_head"):
                self.assertTrue(j["corrected"][name]["unchanged"])
                self.assertEqual(j["corrected"][name]["J"], j["J"])
            self.assertFalse(j["corrected"]["exact"]["unchanged"])
        # CSV: one row per correction
        r = run("analyze", ck, "--heads", H, "--jacobian", "--inputs", xp, "--method", "dense",
                "--format", "csv", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        header = lines[0].split(",")
        for key in ("bound_free", "row_max_min", "saturated_fraction", "ratio_QK_V", "collapsed"):
            self.assertIn(key, header)
        mats = [ln.split(",")[header.index("matrix")] for ln in lines[1:]]
        for m in ("J", "J+lambda_fused", "J+lambda_per_head", "J+exact"):
            self.assertEqual(mats.count(m), H, m)
        # --no-jacobian-corrections
        n = run_json("analyze", ck, "--heads", H, "--jacobian", "--inputs", xp,
                     "--no-jacobian-corrections")
        self.assertNotIn("corrected", n["checkpoints"][0]["layers"][0]["jacobian"][0])


class TestDemoCollapse(Base):
    def test_lambda_10_collapses_layer_0(self):
        keep = os.path.join(self.dir, "demo")
        r = run("demo", "--keep", keep, "--jacobian-layers", "0", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        args = ["analyze", keep, "--lambda", 10, "--jacobian", "--layers", 0,
                "--jacobian-heads", 0]
        rep = run_json(*args)
        j = rep["checkpoints"][0]["layers"][0]["jacobian"][0]
        kx = num(j["theorem34"]["kappa_X"]["kappa"])
        self.assertAlmostEqual(kx, 3.666, delta=5e-4)
        self.assertFalse(j["attention"]["collapsed"])
        for name in ("lambda_fused", "lambda_per_head"):
            c = j["corrected"][name]
            with self.subTest(correction=name):
                self.assertTrue(c["attention"]["collapsed"])
                self.assertEqual(c["attention"]["saturated_diagonal"], 64)
                self.assertLess(num(c["attention"]["ratio_QK_V"]), 1e-20)
                self.assertAlmostEqual(num(c["J"]["kappa"]) / kx, 1, delta=1e-6)
                self.assertIn("kappa(J) = kappa(X): query/key gradients vanish",
                              c["attention"]["note"])
                # the bound without hypothesis is attained at P = I
                self.assertAlmostEqual(num(c["bound_free"]["bound"]) / kx, 1, delta=1e-6)
        self.assertGreater(num(j["J"]["kappa"]), 10 * kx)
        t = run(*args, "--quiet")
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn("attention has collapsed to the identity", t.stdout)
        self.assertIn("+lambda I fused", t.stdout)


class TestVerify(Base):
    def test_bound_free_is_proven_and_lambda_effect_reported(self):
        rep = run_json("verify", "--instances-per-regime", 2)
        bf = rep["proven"]["bound_free"]
        self.assertEqual(bf["violated"], 0)
        self.assertGreater(bf["held"], 0)
        self.assertGreater(bf["not_applicable"], 0)  # N > D regimes
        self.assertTrue(rep["proven_ok"])
        for r in rep["regimes"]:
            for k in ("median_kappa_J_before", "median_kappa_J_after", "lowered", "collapsed"):
                self.assertIn(k, r)
            if r["lambda"] == 0:
                self.assertEqual(r["median_kappa_J_before"], r["median_kappa_J_after"])
        self.assertIn("collapsed", rep["theorem34"])


def main():
    global EXE
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    args, rest = ap.parse_known_args()
    EXE = os.path.abspath(args.exe)
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
