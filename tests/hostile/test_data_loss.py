#!/usr/bin/env python3
"""No run of `spectral-cond` that fails or is refused may destroy or change an existing file.

For every subcommand that writes (kappa --out, jacobian --out, analyze --out, verify --out and
--dump, correct --out, demo --keep): --out equal to an input, a hard link to it, a symbolic link
to it, a device node, a directory, a FIFO, a symbolic link to another file; and runs that fail
for other reasons with an old output in place. After each, every file in the work directory is
byte-identical (sha256), links and special files are what they were, and no temporary file is
left. SIGINT and SIGTERM delivered while the output is being written leave no temporary file
and the old output intact.

Run by ctest:   python test_data_loss.py --exe spectral-cond
With pytest:    SPECTRAL_COND_EXE=... pytest tests/hostile/test_data_loss.py
"""
import argparse
import hashlib
import json
import os
import signal
import stat
import sys
import tempfile
import time
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hostile_run  # noqa: E402
import make_corpus  # noqa: E402

EXE = os.environ.get("SPECTRAL_COND_EXE")


def snapshot(root):
    """path -> what it is: sha256 of a regular file, a link's target, a device's numbers."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    snap[rel] = ("file", hashlib.sha256(f.read()).hexdigest(), st.st_ino)
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = ("dir",)
            else:
                snap[rel] = ("special", stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino)
    return snap


def temporaries(root):
    return [os.path.join(d, n) for d, _, fs in os.walk(root) for n in fs if ".tmp." in n]


class DataLoss(unittest.TestCase):
    def setUp(self):
        if not EXE:
            self.skipTest("set SPECTRAL_COND_EXE or pass --exe")
        self.tmp = tempfile.TemporaryDirectory(prefix="sc-dataloss-")
        self.root = self.tmp.name
        rng = np.random.default_rng(11)
        self.p = {}
        for name, shape in (("X", (4, 8)), ("WQ", (8, 4)), ("WK", (8, 4)), ("WV", (8, 4)),
                            ("M", (5, 3))):
            self.p[name] = self.write(f"{name}.npy", make_corpus.npy_bytes(
                rng.standard_normal(shape)))
        self.p["model"] = self.write("model/model.safetensors", make_corpus.good_st())
        self.p["config"] = self.write("model/config.json", b'{"num_attention_heads": 2}')
        t = make_corpus.timm(layers=2)
        names = sorted(t)
        self.p["shard_a"] = self.write("sharded/a.safetensors",
                                       make_corpus.good_st({n: t[n] for n in names[:2]}))
        self.p["shard_b"] = self.write("sharded/b.safetensors",
                                       make_corpus.good_st({n: t[n] for n in names[2:]}))
        wm = {n: "a.safetensors" if i < 2 else "b.safetensors" for i, n in enumerate(names)}
        self.p["index"] = self.write("sharded/model.safetensors.index.json",
                                     json.dumps({"weight_map": wm}).encode())
        self.p["old"] = self.write("old_report.txt", b"an earlier report, to be kept\n")
        os.link(self.p["M"], self.path("M_hardlink.npy"))
        os.link(self.p["model"], self.path("model_hardlink.safetensors"))
        os.symlink(self.p["M"], self.path("M_symlink.npy"))
        os.symlink(self.p["model"], self.path("model_symlink.safetensors"))
        os.symlink(self.p["old"], self.path("old_symlink.txt"))
        os.symlink(self.p["X"], self.path("X_symlink.npy"))
        os.makedirs(self.path("a_directory"))
        self.write("a_directory/keep.txt", b"keep me\n")
        os.mkfifo(self.path("a_fifo"))
        self.device = None
        try:  # a character device like /dev/null, made here so that /dev is never at risk
            os.mknod(self.path("a_device"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
            self.device = self.path("a_device")
        except (PermissionError, OSError):
            pass
        self.att = ["--x", self.p["X"], "--wq", self.p["WQ"], "--wk", self.p["WK"], "--wv",
                    self.p["WV"]]

    def tearDown(self):
        if hasattr(self, "tmp"):
            self.tmp.cleanup()

    def path(self, rel):
        return os.path.join(self.root, rel)

    def write(self, rel, data):
        p = self.path(rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def targets(self, inputs):
        """Where --out must never write: the inputs, links to them, special files."""
        t = [("input " + os.path.basename(i), i) for i in inputs]
        if self.p["M"] in inputs:
            t += [("hard link", self.path("M_hardlink.npy")),
                  ("symbolic link", self.path("M_symlink.npy"))]
        if self.p["model"] in inputs:
            t += [("hard link", self.path("model_hardlink.safetensors")),
                  ("symbolic link", self.path("model_symlink.safetensors"))]
        if self.p["X"] in inputs:
            t += [("symbolic link", self.path("X_symlink.npy"))]
        t += [("symlink to another file", self.path("old_symlink.txt")),
              ("directory", self.path("a_directory")), ("FIFO", self.path("a_fifo"))]
        if self.device:
            t.append(("device node", self.device))
        return t

    def refused(self, argv, what, timeout=20.0):
        before = snapshot(self.root)
        r = hostile_run.run(EXE, argv, timeout=timeout, address_space=None)
        self.assertFalse(r.timed_out, f"{what}: hang {r}")
        self.assertEqual(r.returncode, 2, f"{what}: not refused: {r}")
        self.assertEqual(len(r.stderr.splitlines()), 1, f"{what}: {r}")
        self.assertEqual(temporaries(self.root), [], f"{what}: temporary file left")
        after = snapshot(self.root)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        self.assertEqual(changed, [], f"{what}: changed {changed}: {r}")

    def check_outputs(self, cmd, argv, inputs):
        """`argv` and `inputs` are functions of self.p: every target gets a fresh work directory,
        so that one destroyed input cannot hide the next case."""
        for k in range(len(self.targets(inputs()))):
            if k > 0:
                self.tearDown()
                self.setUp()
            what, target = self.targets(inputs())[k]
            with self.subTest(cmd=cmd, out=what):
                self.refused([*argv(), "--out", target], f"{cmd} --out {what} ({target})")

    # --- every writing subcommand, --out onto what it must not replace -----------------------

    def test_kappa_matrix(self):
        self.check_outputs("kappa --matrix",
                           lambda: ["kappa", "--matrix", self.p["M"], "--quiet"],
                           lambda: [self.p["M"]])

    def test_kappa_attention(self):
        self.check_outputs("kappa --x", lambda: ["kappa", *self.att, "--quiet"],
                           lambda: [self.p["X"], self.p["WQ"], self.p["WK"], self.p["WV"]])

    def test_jacobian(self):
        self.check_outputs("jacobian", lambda: ["jacobian", *self.att],
                           lambda: [self.p["X"], self.p["WQ"], self.p["WK"], self.p["WV"]])

    def test_analyze(self):
        self.check_outputs("analyze", lambda: ["analyze", self.p["model"], "--quiet"],
                           lambda: [self.p["model"], self.p["config"]])

    def test_analyze_inputs(self):
        self.check_outputs("analyze --inputs",
                           lambda: ["analyze", self.p["model"], "--jacobian", "--inputs",
                                    self.p["X"], "--quiet"],
                           lambda: [self.p["X"]])

    def test_analyze_sharded(self):
        self.check_outputs("analyze sharded",
                           lambda: ["analyze", self.p["index"], "--heads", "2", "--quiet"],
                           lambda: [self.p["index"], self.p["shard_a"], self.p["shard_b"]])

    def test_correct(self):
        self.check_outputs("correct",
                           lambda: ["correct", self.p["model"], "--method", "lambda", "--quiet"],
                           lambda: [self.p["model"], self.p["config"]])

    def test_correct_sharded(self):
        self.check_outputs("correct sharded",
                           lambda: ["correct", self.p["index"], "--heads", "2", "--method",
                                    "exact", "--quiet"],
                           lambda: [self.p["index"], self.p["shard_a"], self.p["shard_b"]])

    def test_verify(self):
        self.check_outputs("verify", lambda: ["verify", "--instances-per-regime", "1", "--quiet"],
                           lambda: [])

    def test_verify_dump_onto_file(self):
        self.refused(["verify", "--instances-per-regime", "2", "--quiet", "--dump", self.p["old"]],
                     "verify --dump onto a regular file")

    def test_demo_keep_existing(self):
        self.refused(["demo", "--keep", self.path("model"), "--quiet"],
                     "demo --keep onto a directory holding model.safetensors")

    def test_demo_keep_file(self):
        self.refused(["demo", "--keep", self.p["old"], "--quiet"], "demo --keep onto a file")

    # --- failed runs with an old output in place ---------------------------------------------

    def test_failed_runs_keep_old_output(self):
        nan = self.write("nan.npy", make_corpus.npy_bytes(np.array([[1.0, np.nan]])))
        out = self.p["old"]
        runs = {
            "kappa, NaN input": ["kappa", "--matrix", nan, "--out", out],
            "jacobian, W_Q of the wrong shape": ["jacobian", "--x", self.p["X"], "--wq",
                                                 self.p["M"], "--wk", self.p["WK"], "--wv",
                                                 self.p["WV"], "--out", out],
            "analyze, no heads": ["analyze", self.p["shard_a"], "--out", out],
            "correct, bad layer": ["correct", self.p["model"], "--method", "lambda",
                                   "--layers", "7", "--out", out],
        }
        for what, argv in runs.items():
            with self.subTest(run=what):
                self.refused(argv, what)

    def test_correct_f16_overflow(self):
        t = make_corpus.timm(dtype=np.float16)
        t["blocks.0.attn.qkv.weight"][0, 0] = np.float16(65500)
        src = self.write("f16/model.safetensors", make_corpus.good_st(t))
        self.refused(["correct", src, "--heads", "2", "--method", "lambda", "--lambda", "100",
                      "--out", self.p["old"]], "correct, W + lambda I overflows F16")

    def test_correct_unlisted_shard_tensor(self):
        t = make_corpus.timm(layers=2)
        names = sorted(t)
        self.write("sh2/a.safetensors", make_corpus.good_st({n: t[n] for n in names[:2]}))
        b = {n: t[n] for n in names[2:]}
        b["blocks.1.extra.weight"] = np.zeros((2, 2), np.float32)
        self.write("sh2/b.safetensors", make_corpus.good_st(b))
        wm = {n: "a.safetensors" if i < 2 else "b.safetensors" for i, n in enumerate(names)}
        idx = self.write("sh2/model.safetensors.index.json",
                         json.dumps({"weight_map": wm}).encode())
        self.refused(["correct", idx, "--heads", "2", "--method", "lambda", "--out",
                      self.p["old"]], "correct, a shard tensor the index does not list")

    # --- signals -----------------------------------------------------------------------------

    def interrupted(self, sig):
        rng = np.random.default_rng(5)
        N, D, d = 48, 64, 32
        big = {}
        for name, shape in (("X", (N, D)), ("WQ", (D, d)), ("WK", (D, d)), ("WV", (D, d))):
            big[name] = self.write(f"big/{name}.npy",
                                   make_corpus.npy_bytes(rng.standard_normal(shape)))
        out = self.write("big/J.npy", b"the previous J, to be kept\n")
        before = snapshot(self.root)
        sent = {}

        def writing(p):
            """A temporary output is open: a named one beside the target, or on Linux an
            unnamed one (O_TMPFILE) in the target's directory, seen among the process's fds."""
            if any(".tmp." in n for n in os.listdir(self.path("big"))):
                return True
            try:
                fds = os.listdir(f"/proc/{p.pid}/fd")
            except OSError:
                return False
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(self.path("big")) and "(deleted)" in target:
                    return True
            return False

        def on_start(p):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and p.poll() is None:
                if writing(p):
                    time.sleep(0.01)  # let it write for a moment
                    os.kill(p.pid, sig)
                    sent["at"] = time.monotonic() - t0
                    return
                time.sleep(0.0005)

        r = hostile_run.run(EXE, ["jacobian", "--x", big["X"], "--wq", big["WQ"], "--wk",
                                  big["WK"], "--wv", big["WV"], "--out", out],
                            timeout=120, address_space=None, on_start=on_start)
        self.assertIn("at", sent, f"the temporary file never appeared: {r}")
        self.assertNotEqual(r.returncode, 0, f"not interrupted: {r}")
        self.assertEqual(temporaries(self.root), [], f"signal {sig}: temporary file left: {r}")
        self.assertEqual(snapshot(self.root), before, f"signal {sig}: files changed")

    def test_sigint(self):
        self.interrupted(signal.SIGINT)

    def test_sigterm(self):
        self.interrupted(signal.SIGTERM)


def main():
    global EXE
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    args, rest = ap.parse_known_args()
    EXE = os.path.abspath(args.exe)
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
