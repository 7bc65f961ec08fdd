#!/usr/bin/env python3
"""`spectral-cond advise` (MATH.md §17), and analyze's --placements variants, against numpy: every grid point's kappa(J) against the
SVD of J by the complex step (test_cli_bias_rope.jacobian) on weights corrected here by hand
(fused, per-head, packed as qkv.weight + lam eye(3D, D), subsets), the saturated fraction from P,
the recommendation's rule recomputed from the report, the sampling of heads, the JSON, CSV and
table formats, and bad arguments (exit 2, one line naming the flag).

Run by ctest:  python test_cli_advise.py --exe spectral-cond
"""
import argparse
import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli_bias_rope import jacobian  # noqa: E402  (the complex-step reference)

EXE = None
TIMEOUT = 300


def run(*args):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=TIMEOUT)


def num(x):
    return float(x)


def layer_normed(rng, N, D):
    X = rng.standard_normal((N, D))
    X -= X.mean(axis=1, keepdims=True)
    return X / np.sqrt((X ** 2).mean(axis=1, keepdims=True))


def svd_kappa(M):
    s = np.linalg.svd(M, compute_uv=False)
    return math.inf if s[-1] == 0 else s[0] / s[-1]


def shifted(W, r0, lam):
    C = W.copy()
    for j in range(W.shape[1]):
        if r0 >= 0 and r0 + j < W.shape[0]:
            C[r0 + j, j] += lam
    return C


class Fixture(unittest.TestCase):
    """Two checkpoints (timm's packed qkv, BERT's separate projections) and LayerNorm'd X."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="sc-advise-")
        rng = np.random.default_rng(20261207)
        cls.D, cls.H, cls.N = 8, 2, 6
        D, H = cls.D, cls.H
        # timm: blocks.i.attn.qkv.weight, 3D x D, rows [Q; K; V]; small weights.
        cls.qkv = [0.1 * rng.standard_normal((3 * D, D)) for _ in range(2)]
        cls.timm = os.path.join(cls.tmp.name, "timm.safetensors")
        save_file({f"blocks.{i}.attn.qkv.weight": w for i, w in enumerate(cls.qkv)}, cls.timm)
        # hf-bert: separate query, key, value Linears.
        cls.sep = {f"encoder.layer.0.attention.self.{n}.weight": 0.1 * rng.standard_normal((D, D))
                   for n in ("query", "key", "value")}
        cls.bert = os.path.join(cls.tmp.name, "bert.safetensors")
        save_file(cls.sep, cls.bert)
        cls.X = layer_normed(rng, cls.N, D)
        cls.xpath = os.path.join(cls.tmp.name, "X.npy")
        np.save(cls.xpath, cls.X)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def advise_json(self, *args):
        r = run("advise", *args, "--format", "json", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)["advice"]


class Advise(Fixture):
    def test_every_point_against_the_complex_step_jacobian(self):
        D, H, d = self.D, self.H, self.D // self.H
        a = self.advise_json(self.timm, "--heads", H, "--inputs", self.xpath, "--lambdas",
                             "0,0.5,2", "--placements", "fused,per_head:qk,packed",
                             "--sample-heads", "all", "--layers", "1")
        self.assertEqual(a["placements"], ["fused", "per_head:qk", "packed"])
        heads = a["checkpoints"][0]["layers"][0]["heads"]
        self.assertEqual([h["head"] for h in heads], [0, 1])
        Wt = self.qkv[1]
        c = 1 / math.sqrt(d)
        for h in heads:
            hh = h["head"]
            for p in h["points"]:
                lam = num(p["lambda"])
                if p["placement"] == "packed":
                    Wc = Wt + lam * np.eye(3 * D, D)  # the paper's literal reading
                    q, k, v = (Wc[b * D + hh * d: b * D + (hh + 1) * d].T for b in range(3))
                else:
                    base = [Wt[b * D + hh * d: b * D + (hh + 1) * d].T for b in range(3)]
                    r0 = {"fused": (hh * d,) * 3, "per_head:qk": (0, 0, -1)}[p["placement"]]
                    q, k, v = (shifted(W, r, lam) for W, r in zip(base, r0))
                J = jacobian(self.X, q, k, v, c=c)
                ref = svd_kappa(J)
                got = num(p["J"]["kappa"])
                acc = num(p["J"]["accuracy"])
                self.assertLessEqual(abs(got - ref), max(acc, 1e-12) * ref + 1e-9 * ref,
                                     (hh, p["placement"], lam))
                for key, W in zip(("kappa_WQ", "kappa_WK", "kappa_WV"), (q, k, v)):
                    self.assertAlmostEqual(num(p[key]) / svd_kappa(W), 1.0, delta=1e-10)
                Z = c * (self.X @ q) @ (self.X @ k).T
                P = np.exp(Z - Z.max(axis=1, keepdims=True))
                P /= P.sum(axis=1, keepdims=True)
                self.assertEqual(num(p["attention"]["saturated_fraction"]),
                                 float(np.mean(P.max(axis=1) > 1 - 1e-6)))
        # The recommendation's rule, recomputed from the report: among the points admissible in
        # both heads, the least median kappa(J).
        best = a["best"]
        cands = []
        for i, p in enumerate(heads[0]["points"]):
            if all(h["points"][i]["admissible"] for h in heads):
                ks = sorted(num(h["points"][i]["J"]["kappa"]) for h in heads)
                cands.append((0.5 * (ks[0] + ks[1]), num(p["lambda"]), p["placement"]))
        if cands:
            m, lam, pl = min(cands)
            self.assertTrue(best["found"])
            self.assertAlmostEqual(num(best["kappa_J"]) / m, 1.0, delta=1e-14)
            self.assertEqual((num(best["lambda"]), best["placement"]), (lam, pl))
        else:
            self.assertFalse(best["found"])

    def test_sampling_is_seeded_and_said(self):
        args = (self.timm, "--heads", self.H, "--tokens", 12, "--lambdas", "0,1",
                "--sample-heads", "1")
        a = self.advise_json(*args, "--seed", 4)
        b = self.advise_json(*args, "--seed", 4)
        for la, lb in zip(a["checkpoints"][0]["layers"], b["checkpoints"][0]["layers"]):
            self.assertEqual([h["head"] for h in la["heads"]], [h["head"] for h in lb["heads"]])
            self.assertEqual(len(la["heads"]), 1)
        self.assertIn("1 heads per layer", a["sampling"])
        self.assertIn("--seed 4", a["sampling"])

    def test_csv_and_table(self):
        args = (self.bert, "--heads", self.H, "--tokens", 10, "--lambdas", "0,1,10",
                "--sample-heads", "all")
        r = run("advise", *args, "--format", "csv", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
        self.assertEqual(len(rows), 2 * 3 * 2)  # heads x lambdas x (fused, per_head)
        self.assertEqual({x["placement"] for x in rows}, {"fused", "per_head"})
        r = run("advise", *args, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("recommendation:", r.stdout)
        self.assertIn("onset of saturation, fused: predicted", r.stdout)

    def test_bad_arguments_exit_2_naming_the_flag(self):
        cases = [
            (("--lambdas", ""), "--lambdas"),
            (("--lambdas", "0,-1"), "--lambdas"),
            (("--lambdas", "0,inf"), "--lambdas"),
            (("--lambdas", "0,nan"), "--lambdas"),
            (("--lambdas", "0,x"), "--lambdas"),
            (("--lambdas", "0,,1"), "--lambdas"),
            (("--placements", "diagonal"), "--placements"),
            (("--placements", "packed:q"), "--placements"),
            (("--placements", ""), "--placements"),
            (("--sample-heads", "0"), "--sample-heads"),
            (("--max-saturated", "2"), "--max-saturated"),
        ]
        for extra, flag in cases:
            with self.subTest(extra=extra):
                r = run("advise", self.bert, "--heads", self.H, "--tokens", 8, *extra)
                self.assertEqual(r.returncode, 2, r.stderr)
                lines = r.stderr.splitlines()
                self.assertEqual(len(lines), 1, r.stderr)
                self.assertIn(flag, lines[0])
        # packed on separate Q/K/V tensors: refused, naming the tensors.
        r = run("advise", self.bert, "--heads", self.H, "--tokens", 8, "--placements", "packed")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--placements packed", r.stderr)
        self.assertIn("query.weight", r.stderr)


class AnalyzePlacements(Fixture):
    """analyze --jacobian --placements: kappa(J) after lam I under the named placements, as
    variants lambda_<name>, against the complex-step J of weights corrected here by hand."""

    def test_placements_as_corrected_variants(self):
        for mask in ("none", "causal"):  # causal: as a decoder computes it
            with self.subTest(mask=mask):
                self.check_placements(mask)
        self.check_placement_errors()

    def check_placements(self, mask):
        D, H, d = self.D, self.H, self.D // self.H
        lam = 0.75
        r = run("analyze", self.timm, "--heads", H, "--jacobian", "--inputs", self.xpath,
                "--lambda", lam, "--placements", "packed,fused:qk,per_head:v", "--layers", "0",
                "--mask", mask, "--format", "json", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        L = json.loads(r.stdout)["checkpoints"][0]["layers"][0]
        Wt = self.qkv[0]
        for h in L["jacobian"]:
            hh = h["head"]
            cor = h["corrected"]
            self.assertEqual(sorted(cor), sorted(["lambda_fused", "lambda_per_head", "exact",
                                                  "lambda_packed", "lambda_fused:qk",
                                                  "lambda_per_head:v"]))
            base = [Wt[b * D + hh * d: b * D + (hh + 1) * d].T for b in range(3)]
            Wc = Wt + lam * np.eye(3 * D, D)
            want = {
                "lambda_packed": [Wc[b * D + hh * d: b * D + (hh + 1) * d].T for b in range(3)],
                "lambda_fused:qk": [shifted(W, r0, lam) for W, r0 in
                                    zip(base, (hh * d, hh * d, -1))],
                "lambda_per_head:v": [shifted(W, r0, lam) for W, r0 in zip(base, (-1, -1, 0))],
                "lambda_fused": [shifted(W, hh * d, lam) for W in base],
                "lambda_per_head": [shifted(W, 0, lam) for W in base],
            }
            for name, (q, k, v) in want.items():
                ref = svd_kappa(jacobian(self.X, q, k, v, c=1 / math.sqrt(d),
                                         causal=mask == "causal"))
                got = num(cor[name]["J"]["kappa"])
                acc = num(cor[name]["J"]["accuracy"])
                self.assertLessEqual(abs(got - ref), max(acc, 1e-12) * ref + 1e-9 * ref,
                                     (hh, name))

    def check_placement_errors(self):
        H = self.H
        r = run("analyze", self.timm, "--heads", H, "--jacobian", "--tokens", 6,
                "--placements", "fused,packed", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("+lambda I packed", r.stdout)
        for extra, needle in ((("--placements", "packed"), "needs --jacobian"),
                              (("--jacobian", "--tokens", 6, "--placements", "diagonal"),
                               "--placements"),
                              (("--jacobian", "--tokens", 6, "--placements", "packed",
                                "--no-jacobian-corrections"), "--no-jacobian-corrections")):
            r = run("analyze", self.timm, "--heads", H, *extra, "--quiet")
            self.assertEqual(r.returncode, 2, (extra, r.stderr))
            self.assertIn(needle, r.stderr)
        r = run("analyze", self.bert, "--heads", H, "--jacobian", "--tokens", 6, "--placements",
                "packed", "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--placements packed", r.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    args, rest = ap.parse_known_args()
    EXE = args.exe
    unittest.main(argv=[sys.argv[0]] + rest)
