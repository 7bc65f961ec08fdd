#!/usr/bin/env python3
"""`spectral-cond kappa` and `spectral-cond verify` end to end, against numpy.

* kappa --matrix against numpy.linalg.svd (relative 1e-12) for square, tall, wide, float32
  and singular matrices ("inf" in JSON, finite kappa_plus, rank), and --rtol;
* kappa --x ...: dense against numpy's SVD of the J written by `spectral-cond jacobian`;
  dense, qr, lobpcg, gram and iterative consistent within their stated accuracy;
* --bound has every documented key, and its bound is the formula of MATH.md §5 on its terms;
* --out writes the same JSON atomically; the table format runs;
* bad inputs exit 2 with one line on stderr, a numerical failure exits 3;
* verify --format json runs, exits 0, and its counts add up; --dump writes each violating
  instance, and the printed `kappa --bound` hint reproduces the violation.

Run by ctest:  python test_cli_kappa.py --exe spectral-cond
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import unittest

import numpy as np

EXE = None
SEED = 20261201


def num(v):
    """A JSON number of the CLI: a float, or inf / -inf / nan from their strings."""
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[v]
    return float(v)


def rel(a, b):
    return abs(a - b) / abs(b)


class CliKappaTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="sc_kappa_")
        self.dir = self.tmp.name
        self.rng = np.random.default_rng(SEED)
        print(f"seed {SEED}", file=sys.stderr)

    def tearDown(self):
        self.tmp.cleanup()

    def save(self, name, a, dtype=np.float64):
        path = os.path.join(self.dir, name)
        np.save(path, a.astype(dtype))
        return path

    def run_cli(self, *args, timeout=300):
        return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout)

    def run_json(self, *args):
        r = self.run_cli(*args, "--format", "json")
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def attention_problem(self, N=4, D=6, dk=3, dv=3, scale=None):
        s = 1 / np.sqrt(D) if scale is None else scale
        mats = {"X": self.rng.standard_normal((N, D)),
                "WQ": self.rng.standard_normal((D, dk)) * s,
                "WK": self.rng.standard_normal((D, dk)) * s,
                "WV": self.rng.standard_normal((D, dv)) * s}
        paths = {k: self.save(k + ".npy", v) for k, v in mats.items()}
        args = ["--x", paths["X"], "--wq", paths["WQ"], "--wk", paths["WK"], "--wv", paths["WV"]]
        return mats, paths, args

    # kappa --matrix -----------------------------------------------------------------------

    def check_matrix(self, M, dtype=np.float64):
        path = self.save("M.npy", M, dtype)
        j = self.run_json("kappa", "--matrix", path)
        s = np.linalg.svd(M.astype(dtype).astype(np.float64), compute_uv=False)
        self.assertEqual(j["input"], "matrix")
        self.assertEqual((j["rows"], j["cols"]), M.shape)
        self.assertLessEqual(rel(num(j["sigma_max"]), s[0]), 1e-12)
        self.assertLessEqual(rel(num(j["sigma_min"]), s[-1]), 1e-12)
        self.assertLessEqual(rel(num(j["kappa"]), s[0] / s[-1]), 1e-12)
        self.assertLessEqual(rel(num(j["kappa_plus"]), s[0] / s[-1]), 1e-12)
        self.assertEqual(j["rank"], min(M.shape))
        self.assertEqual(j["info"], "success")
        for k in ("method", "accuracy", "note", "iterations", "residual", "sigma_min_plus",
                  "rank_tol"):
            self.assertIn(k, j)

    def test_matrix_square_tall_wide_against_numpy(self):
        for shape in [(5, 5), (9, 4), (3, 8), (1, 1), (1, 6), (40, 70)]:
            with self.subTest(shape=shape):
                self.check_matrix(self.rng.standard_normal(shape))

    def test_matrix_float32(self):
        self.check_matrix(self.rng.standard_normal((6, 4)), np.float32)

    def test_singular_matrix(self):
        M = self.rng.standard_normal((6, 4))
        M[:, 3] = M[:, 0] - 2 * M[:, 1]  # rank 3
        j = self.run_json("kappa", "--matrix", self.save("M.npy", M))
        s = np.linalg.svd(M, compute_uv=False)
        self.assertEqual(j["kappa"], "inf")
        self.assertEqual(j["rank"], 3)
        self.assertEqual(j["info"], "singular")
        self.assertIsInstance(j["kappa_plus"], float)
        self.assertLessEqual(rel(j["kappa_plus"], s[0] / s[2]), 1e-12)
        self.assertLessEqual(rel(j["sigma_min_plus"], s[2]), 1e-12)
        # The zero matrix: rank 0, kappa inf, kappa_plus undefined.
        j = self.run_json("kappa", "--matrix", self.save("Z.npy", np.zeros((3, 2))))
        self.assertEqual((j["kappa"], j["kappa_plus"], j["rank"]), ("inf", "nan", 0))

    def test_rtol(self):
        M = np.diag([1.0, 0.7, 0.3])
        j = self.run_json("kappa", "--matrix", self.save("M.npy", M), "--rtol", "0.5")
        self.assertEqual(j["rank"], 2)
        self.assertEqual(j["kappa"], "inf")
        self.assertAlmostEqual(j["kappa_plus"], 1 / 0.7, places=12)
        self.assertAlmostEqual(j["rank_tol"], 0.5, places=15)

    # kappa of J ------------------------------------------------------------------------------

    def test_dense_against_numpy_and_methods_consistent(self):
        for mask in ("none", "causal"):
            with self.subTest(mask=mask):
                mats, paths, args = self.attention_problem()
                jpath = os.path.join(self.dir, "J.npy")
                r = self.run_cli("jacobian", *args, "--mask", mask, "--out", jpath)
                self.assertEqual(r.returncode, 0, r.stderr)
                s = np.linalg.svd(np.load(jpath), compute_uv=False)
                ref = s[0] / s[-1]
                res = {}
                for method in ("dense", "qr", "lobpcg", "gram", "iterative", "auto"):
                    j = self.run_json("kappa", *args, "--mask", mask, "--method", method)
                    res[method] = j
                    self.assertEqual(j["input"], "attention")
                    self.assertEqual((j["rows"], j["cols"]), np.load(jpath).shape)
                    self.assertEqual(j["method_requested"], method)
                    self.assertEqual(j["mask"], mask)
                    self.assertEqual((j["N"], j["D"], j["d_k"], j["d_v"]), (4, 6, 3, 3))
                    self.assertAlmostEqual(j["scale"], 1 / np.sqrt(3), places=15)
                self.assertLessEqual(rel(res["dense"]["kappa"], ref), 1e-10)
                self.assertLessEqual(rel(res["dense"]["sigma_max"], s[0]), 1e-12)
                self.assertLessEqual(rel(res["qr"]["kappa"], ref), 1e-10)
                self.assertLessEqual(rel(res["lobpcg"]["kappa"], ref), 1e-10)
                self.assertLessEqual(rel(res["auto"]["kappa"], ref), 1e-10)
                for m in ("gram", "iterative"):  # squared methods: within their own estimate
                    acc = max(num(res[m]["accuracy"]), 1e-12)
                    self.assertLessEqual(rel(res[m]["kappa"], ref), 10 * acc + 1e-8, m)

    def test_scale_changes_kappa(self):
        _, _, args = self.attention_problem()
        a = self.run_json("kappa", *args, "--scale", "1")
        b = self.run_json("kappa", *args)
        self.assertEqual(a["scale"], 1.0)
        self.assertNotAlmostEqual(a["kappa"], b["kappa"], places=6)

    def test_bound_has_every_term_and_the_formula(self):
        _, _, args = self.attention_problem(N=3, D=7, dk=2, dv=2)
        j = self.run_json("kappa", *args, "--bound", "--method", "dense", "--scale", "1")
        terms = ["X", "Lambda", "WQ", "WK", "WV", "P", "JQ", "JK", "JV"]
        for t in terms:
            self.assertIn("kappa_" + t, j)
            self.assertIn("kappa_plus_" + t, j)
        for k in ("bound", "bound_plus", "ratio", "ratio_plus", "holds", "holds_plus", "vacuous",
                  "verdict", "sigma_max", "sigma_min", "kappa", "kappa_plus", "rank", "method",
                  "accuracy"):
            self.assertIn(k, j)
        self.assertEqual(j["kappa_Lambda"], "inf")
        self.assertEqual(j["bound"], "inf")
        self.assertIs(j["vacuous"], True)
        self.assertIs(j["holds"], True)
        kp = {t: num(j["kappa_plus_" + t]) for t in terms}
        b = kp["X"] ** 3 * kp["Lambda"] * kp["WV"] * (kp["WQ"] + kp["WK"]) + kp["X"] * kp["P"]
        self.assertLessEqual(rel(j["bound_plus"], b), 1e-13)
        self.assertLessEqual(rel(j["ratio_plus"], b / j["kappa_plus"]), 1e-13)
        self.assertEqual(j["holds_plus"], j["kappa_plus"] <= j["bound_plus"])
        # The same numbers as a table.
        r = self.run_cli("kappa", *args, "--bound", "--method", "dense", "--scale", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Theorem 3.4", r.stdout)
        self.assertIn("Lambda", r.stdout)

    def test_out_is_written_atomically(self):
        _, _, args = self.attention_problem()
        out = os.path.join(self.dir, "k.json")
        r = self.run_cli("kappa", *args, "--format", "json", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("written to", r.stdout)
        with open(out) as f:
            j = json.load(f)
        self.assertEqual(j, self.run_json("kappa", *args))
        self.assertEqual(sorted(os.listdir(self.dir)).count("k.json"), 1)
        self.assertFalse([n for n in os.listdir(self.dir) if ".tmp." in n])
        r = self.run_cli("kappa", *args, "--out", out, "--quiet")
        self.assertEqual((r.returncode, r.stdout, r.stderr), (0, "", ""))

    # errors ----------------------------------------------------------------------------------

    def expect_error(self, args, code=2, contains=None):
        r = self.run_cli(*args)
        self.assertEqual(r.returncode, code, (args, r.stdout, r.stderr))
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertTrue(lines[0].startswith("spectral-cond: error: "), lines[0])
        if contains:
            self.assertIn(contains, lines[0])
        return lines[0]

    def test_bad_inputs_exit_2_with_one_line(self):
        mats, paths, args = self.attention_problem()
        M = self.save("M.npy", self.rng.standard_normal((3, 3)))
        bad_wk = self.save("badWK.npy", self.rng.standard_normal((5, 3)))
        vec = self.save("vec.npy", np.ones(4))
        nan = self.save("nan.npy", np.array([[1.0, np.nan]]))
        missing = os.path.join(self.dir, "missing.npy")
        self.expect_error(["kappa", "--matrix", missing], contains="missing.npy")
        self.expect_error(["kappa", "--matrix", vec], contains="2-D")
        self.expect_error(["kappa", "--matrix", nan], contains="NaN")
        self.expect_error(["kappa"], contains="nothing to do")
        self.expect_error(["kappa", "--matrix", M, *args], contains="not both")
        self.expect_error(["kappa", "--matrix", M, "--bound"], contains="--bound")
        self.expect_error(["kappa", "--matrix", M, "--method", "qr"], contains="--method")
        self.expect_error(["kappa", "--matrix", M, "--rtol", "1"], contains="--rtol")
        self.expect_error(["kappa", *args[:6]], contains="missing --wv")
        wk = list(args)
        wk[5] = bad_wk
        self.expect_error(["kappa", *wk], contains="badWK.npy")
        self.expect_error(["kappa", *args, "--scale", "-1"], contains="--scale")
        self.expect_error(["kappa", *args, "--tol", "0"], contains="--tol")
        self.expect_error(["kappa", *args, "--method", "magic"])
        self.expect_error(["kappa", *args, "--format", "xml"])
        self.expect_error(["kappa", *args, "--out", os.path.join(self.dir, "no", "such", "f")],
                          contains="no/such")
        line = self.expect_error(["kappa", *args, "--device", "cuda"])
        self.assertIn("built without CUDA (configure with -DSPECTRAL_COND_ENABLE_CUDA=ON)", line)
        self.expect_error(["verify", "--instances-per-regime", "0"], contains="instances")

    def test_numerical_failure_exits_3(self):
        mats, paths, args = self.attention_problem(N=3, D=4, dk=2, dv=2)
        np.save(paths["X"], mats["X"] * 1e200)  # finite inputs whose logits overflow
        self.expect_error(["kappa", *args], code=3, contains="NaN or Inf")

    def test_max_iterations_caps_matfree(self):
        mats, paths, args = self.attention_problem(N=24, D=32, dk=4, dv=4)
        j = self.run_json("kappa", *args, "--method", "matfree")
        self.assertEqual(j["info"], "success")
        jpath = os.path.join(self.dir, "J.npy")  # J itself is checked against differences
        r = self.run_cli("jacobian", *args, "--out", jpath)
        self.assertEqual(r.returncode, 0, r.stderr)
        s = np.linalg.svd(np.load(jpath), compute_uv=False)
        self.assertLessEqual(rel(num(j["sigma_min"]), s[-1]), 1e-8)
        # The stated accuracy is a bound the answer meets (Temple's, where the note names it).
        self.assertLessEqual(rel(num(j["sigma_min"]), s[-1]), 20 * num(j["accuracy"]))
        self.assertIn("Temple's bound", j["note"])
        self.assertGreater(j["iterations"], 3)  # else the cap below would not bite
        # Capped below what it needs: it declines (exit 3), and says so in the report.
        r = self.run_cli("kappa", *args, "--method", "matfree", "--max-iterations", "2",
                         "--format", "json", "--quiet")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("did not converge", r.stderr)
        jc = json.loads(r.stdout)
        self.assertEqual(jc["info"], "not_converging")
        self.assertIn("; 2 iterations", jc["note"])  # LOBPCG's, after Lanczos for sigma_max
        self.expect_error(["kappa", *args, "--max-iterations", "0"], contains="--max-iterations")
        # The coarse level: on by default (16 modes, capped at N), off with --coarse 0; both agree.
        self.assertIn("coarse level on the 16 smallest eigenvectors", j["note"])
        j0 = self.run_json("kappa", *args, "--method", "matfree", "--coarse", "0")
        self.assertEqual(j0["info"], "success")
        self.assertNotIn("coarse level", j0["note"])
        self.assertLessEqual(rel(num(j0["sigma_min"]), s[-1]), 1e-8)
        self.expect_error(["kappa", *args, "--coarse", "-1"], contains="--coarse")
        self.expect_error(["kappa", "--matrix", paths["X"], "--coarse", "4"],
                          contains="--coarse applies to attention inputs")
        self.expect_error(["kappa", "--matrix", paths["X"], "--max-iterations", "5"],
                          contains="--max-iterations applies to attention inputs")

    # verify ----------------------------------------------------------------------------------

    def test_verify_json_runs_and_counts_add_up(self):
        out = os.path.join(self.dir, "v.json")
        dump = os.path.join(self.dir, "dump")
        r = self.run_cli("verify", "--format", "json", "--instances-per-regime", "1",
                         "--seed", "7", "--out", out, "--dump", dump, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out) as f:
            j = json.load(f)
        self.assertIs(j["proven_ok"], True)
        self.assertEqual(j["seed"], 7)
        self.assertEqual(j["instances"], len(j["regimes"]))
        self.assertEqual(len(j["regimes"]), 3 * 2 * 3 * 2 * 4)
        for k, c in j["proven"].items():
            self.assertEqual(c["violated"], 0, k)
        t = j["theorem34"]
        self.assertEqual(t["held_plus"] + t["violated_plus"] + t["inconclusive_plus"],
                         j["instances"])
        self.assertEqual(t["vacuous"], j["instances"])
        self.assertEqual(sum(g["instances"] for g in j["regimes"]), j["instances"])
        self.assertEqual(t["violated_plus"],
                         sum(1 for v in j["violations"] if v["statement"] == "theorem34_plus"))
        # Each violation's hint reproduces it with `kappa --bound`.
        for v in j["violations"][:3]:
            self.assertFalse(v["proven"])
            cmd = shlex.split(v["hint"])
            self.assertEqual(cmd[:2], ["spectral-cond", "kappa"])
            k = self.run_json(*cmd[1:])
            self.assertGreater(k["kappa_plus"], k["bound_plus"])
            self.assertEqual(k["verdict_plus"], "violated")
            self.assertEqual((k["N"], k["D"], k["d_k"], k["d_v"]),
                             (v["N"], v["D"], v["d_k"], v["d_v"]))
            self.assertLessEqual(rel(k["kappa_plus"], v["lhs"]), 1e-12)
        # Deterministic: the same seed gives the same report.
        r2 = self.run_cli("verify", "--format", "json", "--instances-per-regime", "1",
                          "--seed", "7")
        self.assertEqual(r2.returncode, 0, r2.stderr)
        j2 = json.loads(r2.stdout)
        self.assertEqual(j2["regimes"], j["regimes"])

    def test_verify_table_writes_a_dash_where_nothing_is_reported(self):
        # A group without a real ratio has no worst ratio (NaN in the sweep): the table says "-".
        r = self.run_cli("verify", "--instances-per-regime", "1", "--seed", "7", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("worst -)", r.stdout)
        self.assertNotRegex(r.stdout, r"\bnan\b")

    def test_help_exits_0(self):
        for cmd in ("kappa", "verify"):
            r = self.run_cli(cmd, "--help")
            self.assertEqual(r.returncode, 0)
            self.assertIn("--format", r.stdout)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    args, rest = ap.parse_known_args()
    EXE = args.exe
    unittest.main(argv=[sys.argv[0], *rest])
