#!/usr/bin/env python3
"""`spectral-cond jacobian` end to end, against numpy.

* inputs written by numpy in float32 and float64, C and Fortran order;
* the written J (every block) against central finite differences of an independent numpy
  implementation of attention, column by column, in MATH.md §1's column-major convention;
* --gram against J J^T of the written J;
* the CLI's output bit for bit against the library called directly (sc_jacobian_reference),
  and against itself (determinism);
* bad inputs exit with code 2 and one line on stderr naming the file, numerical failure with
  code 3, and no output or temporary file is left behind.

Run by ctest:  python test_cli_jacobian.py --exe spectral-cond --reference sc_jacobian_reference
"""
import argparse
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

EXE = None
REF = None
SEED = 20261130


def vec(a):
    """Column-major vec (MATH.md §1)."""
    return a.reshape(-1, order="F")


def attention(X, WQ, WK, WV, c, causal):
    """A = softmax_row(c Q K^T + M) V, written independently of the library."""
    Q, K, V = X @ WQ, X @ WK, X @ WV
    Z = c * (Q @ K.T)
    if causal:
        Z = Z + np.triu(np.full(Z.shape, -np.inf), 1)
    Z = Z - Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    P /= P.sum(axis=1, keepdims=True)
    return P @ V


def fd_column(f, base, idx, h=1e-5):
    """Central difference of vec(f(.)) with respect to base[idx]."""
    plus, minus = base.copy(), base.copy()
    plus[idx] += h
    minus[idx] -= h
    return (vec(f(plus)) - vec(f(minus))) / (2 * h)


class Problem:
    def __init__(self, N, D, dk, dv, rng):
        self.N, self.D, self.dk, self.dv = N, D, dk, dv
        self.X = rng.standard_normal((N, D))
        s = 1 / np.sqrt(D)
        self.WQ = rng.standard_normal((D, dk)) * s
        self.WK = rng.standard_normal((D, dk)) * s
        self.WV = rng.standard_normal((D, dv)) * s


class CliJacobianTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="sc_cli_")
        self.dir = self.tmp.name
        self.outdir = os.path.join(self.dir, "out")
        os.mkdir(self.outdir)
        self.rng = np.random.default_rng(SEED)
        print(f"seed {SEED}", file=sys.stderr)

    def tearDown(self):
        self.tmp.cleanup()

    # helpers ------------------------------------------------------------------------------

    def save(self, name, a, dtype=np.float64, fortran=False):
        """Writes `a` as `name` in the given dtype and order; returns (path, value as read)."""
        a = a.astype(dtype)
        a = np.asfortranarray(a) if fortran else np.ascontiguousarray(a)
        path = os.path.join(self.dir, name)
        np.save(path, a)
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            _, fortran_order, _ = np.lib.format.read_array_header_1_0(f)
        self.assertEqual(fortran_order, fortran and a.ndim == 2 and min(a.shape) > 1)
        return path, a.astype(np.float64)

    def save_problem(self, p, kinds=None):
        """Saves X, W_Q, W_K, W_V: float32 and float64, C and Fortran order mixed."""
        kinds = kinds or {"X": (np.float64, False), "WQ": (np.float32, False),
                          "WK": (np.float64, True), "WV": (np.float32, True)}
        paths, vals = {}, {}
        for key in ("X", "WQ", "WK", "WV"):
            dtype, fortran = kinds[key]
            paths[key], vals[key] = self.save(key + ".npy", getattr(p, key), dtype, fortran)
        return paths, vals

    def run_cli(self, *args):
        return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=120)

    def jacobian_args(self, paths, out, *extra):
        return ["jacobian", "--x", paths["X"], "--wq", paths["WQ"], "--wk", paths["WK"],
                "--wv", paths["WV"], "--out", out, *extra]

    def load_output(self, path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            _, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        self.assertEqual(version, (1, 0))
        self.assertFalse(fortran_order)
        self.assertEqual(dtype, np.dtype("<f8"))
        return np.load(path)

    def assert_no_leftovers(self, out):
        self.assertFalse(os.path.exists(out), f"{out} was written")
        left = [n for n in os.listdir(self.outdir) if ".tmp." in n]
        self.assertEqual(left, [], "temporary files left behind")

    def columns_to_check(self, ncols):
        picks = {0, ncols - 1, ncols // 2}
        picks.update(int(i) for i in self.rng.integers(0, ncols, size=3))
        return sorted(picks)

    # tests --------------------------------------------------------------------------------

    def test_every_block_against_finite_differences(self):
        p = Problem(4, 5, 3, 2, self.rng)
        paths, v = self.save_problem(p)
        X, WQ, WK, WV = v["X"], v["WQ"], v["WK"], v["WV"]
        N, D, dk, dv = p.N, p.D, p.dk, p.dv
        for scale_arg, causal in ((None, False), ("0.75", True), ("1", False)):
            c = 1 / np.sqrt(dk) if scale_arg is None else float(scale_arg)
            extra = ([] if scale_arg is None else ["--scale", scale_arg]) + \
                    (["--mask", "causal"] if causal else [])
            # The parameter blocks: (name, matrix, column offset within All, f(W) -> A)
            fq = lambda W: attention(X, W, WK, WV, c, causal)
            fk = lambda W: attention(X, WQ, W, WV, c, causal)
            fv = lambda W: attention(X, WQ, WK, W, c, causal)
            fx = lambda Y: attention(Y, WQ, WK, WV, c, causal)
            parts = {"q": (WQ, 0, fq), "k": (WK, D * dk, fk), "v": (WV, 2 * D * dk, fv)}
            J = {}
            for block in ("all", "q", "k", "v", "x"):
                with self.subTest(scale=scale_arg, causal=causal, block=block):
                    out = os.path.join(self.outdir, f"J_{block}.npy")
                    r = self.run_cli(*self.jacobian_args(paths, out, "--block", block, *extra))
                    self.assertEqual(r.returncode, 0, r.stderr)
                    self.assertIn("written to " + out, r.stdout)
                    J[block] = self.load_output(out)
                    ncols = {"all": 2 * D * dk + D * dv, "q": D * dk, "k": D * dk,
                             "v": D * dv, "x": N * D}[block]
                    self.assertEqual(J[block].shape, (N * dv, ncols))
            for block, (W, offset, f) in parts.items():
                with self.subTest(scale=scale_arg, causal=causal, block=block):
                    self.assertTrue(np.array_equal(
                        J["all"][:, offset:offset + W.size], J[block]))
                    for col in self.columns_to_check(W.size):
                        a, b = col % D, col // D  # column a + D b is W(a, b)
                        ref = fd_column(f, W, (a, b))
                        err = np.abs(J[block][:, col] - ref).max()
                        self.assertLess(err, 1e-7 * max(1.0, np.abs(ref).max()),
                                        f"column {col} = W({a}, {b})")
            with self.subTest(scale=scale_arg, causal=causal, block="x"):
                for col in self.columns_to_check(N * D):
                    r_, a = col % N, col // N  # column r + N a is X(r, a)
                    ref = fd_column(fx, X, (r_, a))
                    err = np.abs(J["x"][:, col] - ref).max()
                    self.assertLess(err, 1e-7 * max(1.0, np.abs(ref).max()), f"column {col}")

    def test_gram_is_J_JT(self):
        p = Problem(5, 3, 2, 3, self.rng)
        paths, _ = self.save_problem(p)
        for block in ("all", "q", "v", "x"):
            with self.subTest(block=block):
                oj = os.path.join(self.outdir, "J.npy")
                og = os.path.join(self.outdir, "G.npy")
                r = self.run_cli(*self.jacobian_args(paths, oj, "--block", block))
                self.assertEqual(r.returncode, 0, r.stderr)
                r = self.run_cli(*self.jacobian_args(paths, og, "--block", block, "--gram"))
                self.assertEqual(r.returncode, 0, r.stderr)
                J, G = self.load_output(oj), self.load_output(og)
                self.assertEqual(G.shape, (p.N * p.dv, p.N * p.dv))
                ref = J @ J.T
                self.assertLess(np.abs(G - ref).max(), 1e-12 * np.abs(ref).max())

    def test_bit_for_bit_with_the_library_and_deterministic(self):
        p = Problem(6, 4, 3, 2, self.rng)
        paths, _ = self.save_problem(p)
        cases = [(None, "none", "all", False), ("0.5", "causal", "all", False),
                 (None, "none", "x", False), ("2", "none", "k", True), (None, "causal", "all", True)]
        for scale, mask, block, gram in cases:
            with self.subTest(scale=scale, mask=mask, block=block, gram=gram):
                out = os.path.join(self.outdir, "cli.npy")
                out2 = os.path.join(self.outdir, "cli2.npy")
                ref = os.path.join(self.outdir, "ref.npy")
                extra = ["--mask", mask, "--block", block] + (["--gram"] if gram else []) + \
                        ([] if scale is None else ["--scale", scale])
                for o in (out, out2):
                    r = self.run_cli(*self.jacobian_args(paths, o, *extra))
                    self.assertEqual(r.returncode, 0, r.stderr)
                r = subprocess.run([REF, paths["X"], paths["WQ"], paths["WK"], paths["WV"],
                                    scale or "default", mask, block, "1" if gram else "0", ref],
                                   capture_output=True, text=True, timeout=120)
                self.assertEqual(r.returncode, 0, r.stderr)
                with open(out, "rb") as f1, open(out2, "rb") as f2, open(ref, "rb") as f3:
                    a, b, c = f1.read(), f2.read(), f3.read()
                self.assertEqual(a, b, "two runs differ")
                self.assertEqual(a, c, "CLI and library differ")

    def expect_bad_input(self, args, names, out, code=2):
        r = self.run_cli(*args)
        self.assertEqual(r.returncode, code, f"stdout: {r.stdout!r} stderr: {r.stderr!r}")
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertTrue(lines[0].startswith("spectral-cond: error: "), lines[0])
        self.assertIn(names, lines[0])
        self.assertEqual(r.stdout, "")
        self.assert_no_leftovers(out)
        return lines[0]

    def test_bad_inputs_exit_2_and_leave_nothing(self):
        p = Problem(3, 4, 2, 2, self.rng)
        paths, _ = self.save_problem(p)
        out = os.path.join(self.outdir, "J.npy")
        d = self.dir

        def variant(key, path):
            q = dict(paths)
            q[key] = path
            return self.jacobian_args(q, out)

        # A truncated file, a wrong magic, a big-endian and an integer file.
        with open(paths["X"], "rb") as f:
            raw = f.read()
        trunc = os.path.join(d, "trunc.npy")
        with open(trunc, "wb") as f:
            f.write(raw[:-8])
        magic = os.path.join(d, "magic.npy")
        with open(magic, "wb") as f:
            f.write(b"PK" + raw[2:])
        big = os.path.join(d, "big.npy")
        np.save(big, p.WQ.astype(">f8"))
        ints = os.path.join(d, "ints.npy")
        np.save(ints, np.ones((4, 2), dtype=np.int64))
        vec1d = os.path.join(d, "vec.npy")
        np.save(vec1d, np.ones(4))
        nan = os.path.join(d, "nan.npy")
        Xn = p.X.copy()
        Xn[1, 2] = np.nan
        np.save(nan, Xn)
        wk_wide = os.path.join(d, "wk_wide.npy")
        np.save(wk_wide, np.ones((4, 3)))
        wv_tall = os.path.join(d, "wv_tall.npy")
        np.save(wv_tall, np.ones((5, 2)))
        missing = os.path.join(d, "missing.npy")

        msg = self.expect_bad_input(variant("X", trunc), trunc, out)
        self.assertIn("truncated", msg)
        self.expect_bad_input(variant("WQ", magic), magic, out)
        self.expect_bad_input(variant("WQ", big), big, out)
        self.expect_bad_input(variant("WV", ints), ints, out)
        self.expect_bad_input(variant("X", vec1d), vec1d, out)
        self.expect_bad_input(variant("X", nan), nan, out)
        msg = self.expect_bad_input(variant("WK", wk_wide), wk_wide, out)
        self.assertIn("4 x 2", msg)  # the expected shape
        msg = self.expect_bad_input(variant("WV", wv_tall), wv_tall, out)
        self.assertIn("4 x 2", msg)
        self.expect_bad_input(variant("WK", missing), missing, out)
        for s in ("-1", "0", "nan", "inf"):
            self.expect_bad_input(self.jacobian_args(paths, out, "--scale", s), "--scale", out)
        self.expect_bad_input(self.jacobian_args(paths, out, "--block", "z"), "--block", out)
        self.expect_bad_input(self.jacobian_args(paths, out, "--mask", "full"), "--mask", out)
        self.expect_bad_input(["jacobian", "--x", paths["X"]], "--wq", out)
        self.expect_bad_input([], "subcommand", out)
        # The output cannot be written: its directory does not exist.
        bad_out = os.path.join(self.outdir, "no", "J.npy")
        self.expect_bad_input(self.jacobian_args(paths, bad_out), bad_out, out)

    def test_failure_leaves_an_existing_output_untouched(self):
        p = Problem(3, 4, 2, 2, self.rng)
        paths, _ = self.save_problem(p)
        out = os.path.join(self.outdir, "J.npy")
        with open(out, "wb") as f:
            f.write(b"old")
        r = self.run_cli(*self.jacobian_args(paths, out, "--scale", "-1"))
        self.assertEqual(r.returncode, 2)
        with open(out, "rb") as f:
            self.assertEqual(f.read(), b"old")
        r = self.run_cli(*self.jacobian_args(paths, out))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.load_output(out).shape, (p.N * p.dv, 2 * p.D * p.dk + p.D * p.dv))
        self.assertEqual([n for n in os.listdir(self.outdir)], ["J.npy"])

    def test_numerical_failure_exits_3(self):
        p = Problem(3, 4, 2, 2, self.rng)
        p.X *= 1e200  # finite inputs whose logits overflow
        paths, _ = self.save_problem(p, {k: (np.float64, False) for k in ("X", "WQ", "WK", "WV")})
        out = os.path.join(self.outdir, "J.npy")
        r = self.run_cli(*self.jacobian_args(paths, out))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("NaN or Inf", r.stderr)
        self.assert_no_leftovers(out)

    def test_help_exits_0(self):
        r = self.run_cli("jacobian", "--help")
        self.assertEqual(r.returncode, 0)
        self.assertIn("--gram", r.stdout)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--reference", required=True)
    args, rest = ap.parse_known_args()
    EXE, REF = args.exe, args.reference
    unittest.main(argv=[sys.argv[0], *rest])
