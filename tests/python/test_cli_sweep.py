"""`spectral-cond analyze --jacobian` at scale: --jobs, --shard with `merge`, and spectral-cond-mpi.

On a 4-layer model (timm layout with biases, 4 heads each), every way of spreading the work must
give the serial report: the JSON documents are compared whole, with only the "seconds" timings
removed; the CSV report byte for byte. Errors must be the serial run's: a model with overflowing
weights in two heads fails on the first of them, whatever the threads. `merge` refuses a missing,
repeated or foreign shard, naming the file. spectral-cond-mpi runs under mpirun with 1 and 2 ranks
where the build has it (--mpi-exe).

Run by ctest:  python test_cli_sweep.py --exe spectral-cond [--mpi-exe spectral-cond-mpi
                                                              --mpirun mpiexec]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from safetensors.numpy import save_file

EXE = None
MPI_EXE = None
MPIRUN = None
TIMEOUT = 300
D, HEADS, LAYERS = 16, 4, 4


def run(*args, exe=None, env=None):
    return subprocess.run([exe or EXE, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=None if env is None else dict(os.environ, **env))


def mpirun(np_, *args):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    return subprocess.run([MPIRUN, "-np", str(np_), MPI_EXE, *map(str, args)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)


def without_seconds(x):
    if isinstance(x, dict):
        return {k: without_seconds(v) for k, v in x.items() if k != "seconds"}
    if isinstance(x, list):
        return [without_seconds(v) for v in x]
    return x


def make_model(path, rng, overflow_heads=()):
    tensors = {}
    for i in range(LAYERS):
        T = rng.standard_normal((3 * D, D)) * 0.3
        d = D // HEADS
        for h in overflow_heads:  # head h of layer 1: Q and K about 1e200, logits beyond double
            if i == 1:
                for block in (0, D):  # the rows of W_Q^T, then of W_K^T
                    T[block + h * d:block + (h + 1) * d] *= 1e200
        tensors[f"blocks.{i}.attn.qkv.weight"] = T
        tensors[f"blocks.{i}.attn.qkv.bias"] = rng.standard_normal(3 * D) * 0.1
    save_file(tensors, path)


class Sweep(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        rng = np.random.default_rng(20261203)
        cls.model = os.path.join(cls.tmp.name, "model.safetensors")
        make_model(cls.model, rng)
        cls.bad = os.path.join(cls.tmp.name, "bad.safetensors")
        make_model(cls.bad, rng, overflow_heads=(1, 3))
        cls.args = ["--heads", HEADS, "--jacobian", "--tokens", 8, "--quiet"]
        cls.serial = cls.analyze("--jobs", 1)
        cls.serial_doc = json.loads(cls.serial)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def analyze(cls, *extra, fmt="json", model=None):
        r = run("analyze", model or cls.model, *cls.args, "--format", fmt, *extra)
        if r.returncode != 0:
            raise AssertionError(f"analyze {extra} failed ({r.returncode}): {r.stderr}")
        return r.stdout

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    @staticmethod
    def read(path):
        with open(path) as f:
            return f.read()

    def load(self, path):
        return json.loads(self.read(path))

    def assert_same_report(self, text, want=None):
        self.assertEqual(without_seconds(json.loads(text)),
                         without_seconds(want if want is not None else self.serial_doc))

    def test_the_serial_report_has_every_head(self):
        layers = self.serial_doc["checkpoints"][0]["layers"]
        self.assertEqual(len(layers), LAYERS)
        for L in layers:
            self.assertEqual([j["head"] for j in L["jacobian"]], list(range(HEADS)))
            self.assertIsNotNone(L["biases"]["b_Q"])

    def test_jobs_give_the_serial_report(self):
        for jobs in (2, 3, 0):
            with self.subTest(jobs=jobs):
                self.assert_same_report(self.analyze("--jobs", jobs))
        self.assertEqual(self.analyze("--jobs", 2, fmt="csv"), self.analyze("--jobs", 1, fmt="csv"))
        # Without --jacobian, the three projections of a layer run on the threads.
        for jobs in (2, 0):
            with self.subTest(weights_only=jobs):
                a = run("analyze", self.model, "--heads", HEADS, "--per-head", "--format", "csv",
                        "--jobs", jobs)
                b = run("analyze", self.model, "--heads", HEADS, "--per-head", "--format", "csv",
                        "--jobs", 1)
                self.assertEqual((a.returncode, b.returncode), (0, 0), a.stderr + b.stderr)
                self.assertEqual(a.stdout, b.stdout)

    def test_the_blas_thread_count_does_not_change_the_report(self):
        # OpenBLAS's SVD rounds differently on 1 and 2 threads; the tool pins it to one
        # (blas_threads.hpp), as mpirun's core binding would.
        for n in ("1", "2"):
            with self.subTest(OPENBLAS_NUM_THREADS=n):
                r = run("analyze", self.model, *self.args, "--format", "json",
                        env={"OPENBLAS_NUM_THREADS": n})
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assert_same_report(r.stdout)

    def test_jobs_fail_on_the_serial_runs_first_error(self):
        # Heads 1 and 3 of layer 1 overflow; with the corrections, the exact correction of the
        # whole W_Q spreads its large singular value into head 0's columns too.
        for extra, head in ((("--no-jacobian-corrections",), 1), ((), 0)):
            msgs = []
            for jobs in (1, 2, 4):
                r = run("analyze", self.bad, *self.args, *extra, "--jobs", jobs)
                self.assertEqual(r.returncode, 3, r.stderr)
                self.assertEqual(r.stdout, "")
                msgs.append(r.stderr)
            self.assertIn(f"layer 1 head {head} ", msgs[0])
            self.assertEqual(msgs[1], msgs[0])
            self.assertEqual(msgs[2], msgs[0])

    def shards(self, n, *extra):
        paths = []
        for i in range(n):
            p = self.path(f"shard{i}of{n}{'-'.join(map(str, extra))}.json")
            self.analyze("--shard", f"{i}/{n}", "--out", p, *extra)
            paths.append(p)
        return paths

    def test_shards_merge_into_the_serial_report(self):
        paths = self.shards(2)
        parts = [self.load(p) for p in paths]
        self.assertEqual(parts[1]["shard"], {"index": 1, "count": 2})
        # Items are numbered across layers: shard 0 has heads 0 and 2 of every layer.
        self.assertEqual([j["head"] for j in parts[0]["checkpoints"][0]["layers"][0]["jacobian"]],
                         [0, 2])
        r = run("merge", *reversed(paths))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_report(r.stdout)
        out = self.path("merged.json")
        r = run("merge", *paths, "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_report(self.read(out))

    def test_shards_with_layers_they_do_not_touch(self):
        # One head per layer, 4 items over 3 shards: shard 1 and 2 each miss three layers.
        want = json.loads(self.analyze("--jacobian-heads", 0, "--jobs", 1))
        paths = self.shards(3, "--jacobian-heads", 0)
        one = self.load(paths[1])
        self.assertEqual([len(L["jacobian"]) for L in one["checkpoints"][0]["layers"]],
                         [0, 1, 0, 0])
        r = run("merge", *paths)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_report(r.stdout, want)

    def expect_bad(self, r, *names):
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(r.stdout, "")
        self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)
        for n in names:
            self.assertIn(n, r.stderr)

    def test_merge_refuses_what_is_not_the_shards_of_one_run(self):
        paths = self.shards(2)
        self.expect_bad(run("merge", paths[0]), "1 reports given for the 2 shards")
        self.expect_bad(run("merge", paths[0], paths[0]), "repeats", paths[0])
        other = self.path("other.json")
        self.analyze("--shard", "1/2", "--lambda", 3, "--out", other)
        self.expect_bad(run("merge", paths[0], other), other, "/checkpoints/0/lambda")
        three = self.shards(3)
        self.expect_bad(run("merge", paths[0], three[1]), three[1], "not one of the 2 shards")
        plain = self.path("plain.json")
        with open(plain, "w") as f:
            f.write(self.serial)
        self.expect_bad(run("merge", plain, paths[1]), plain, "not a shard")
        junk = self.path("junk.json")
        with open(junk, "w") as f:
            f.write("{\"tool\": ")
        self.expect_bad(run("merge", junk, paths[1]), junk, "not JSON")
        before = self.read(paths[0])
        self.expect_bad(run("merge", *paths, "--out", paths[0]), paths[0], "input")
        self.assertEqual(self.read(paths[0]), before)

    def test_shard_arguments(self):
        for bad in ("2/2", "1", "a/2", "0/0", "-1/2"):
            with self.subTest(shard=bad):
                self.expect_bad(run("analyze", self.model, *self.args, "--shard", bad,
                                    "--format", "json"), "--shard")
        self.expect_bad(run("analyze", self.model, *self.args, "--shard", "0/2"),
                        "--shard needs --format json")
        self.expect_bad(run("analyze", self.model, "--heads", HEADS, "--shard", "0/2"),
                        "--shard needs --jacobian")

    DECLINED = ("not_converging", "inaccurate", "too_large", "invalid_input")

    def declined_in(self, doc):
        """(layer, head, variant) of every kappa(J) the report declines, read from the JSON."""
        out = []
        for L in doc["checkpoints"][0]["layers"]:
            for j in L["jacobian"]:
                entries = [("J", j), *sorted(j.get("corrected", {}).items())]
                for name, e in entries:
                    if e["J"]["info"] in self.DECLINED or e["J"]["kappa"] == "nan":
                        out.append((L["index"], j["head"], name))
        return out

    def test_declined_answers_are_written_then_exit_3(self):
        # gram squares J: at logit scale 30 some heads' J are beyond its resolution, and it
        # declines them (inaccurate, kappa nan). The report is written whole, then exit 3 with
        # one line naming the first declined answer and the count; never nan with exit 0.
        extra = ("--method", "gram", "--scale", 30)
        out = self.path("declined.json")
        r = run("analyze", self.model, *self.args, *extra, "--format", "json", "--out", out)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertEqual(len(r.stderr.splitlines()), 1, r.stderr)
        doc = self.load(out)
        declined = self.declined_in(doc)
        self.assertGreater(len(declined), 0)
        self.assertLess(len(declined), LAYERS * HEADS * 4)  # some heads are answered
        self.assertIn(f"{len(declined)} kappa(J) answer(s) declined", r.stderr)
        layer, head, name = declined[0]
        self.assertIn(f"layer {layer} head {head}" + ("" if name == "J" else f" ({name})"),
                      r.stderr)
        # The same in every format, on stdout; and with every head on threads.
        for fmt in ("table", "csv"):
            r = run("analyze", self.model, *self.args, *extra, "--format", fmt)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertIn("Jacobian of each head" if fmt == "table" else ",J,", r.stdout)
        r = run("analyze", self.model, *self.args, *extra, "--format", "json", "--jobs", 2)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assert_same_report(r.stdout, doc)
        # Shards: each exits 3 where it holds a declined answer, and merge says it again.
        paths, codes = [], []
        for i in range(2):
            p = self.path(f"declined{i}.json")
            r = run("analyze", self.model, *self.args, *extra, "--format", "json",
                    "--shard", f"{i}/2", "--out", p)
            codes.append(r.returncode)
            self.assertEqual(r.returncode, 3 if self.declined_in(self.load(p)) else 0, r.stderr)
            paths.append(p)
        self.assertIn(3, codes)
        r = run("merge", *paths)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn(f"{len(declined)} kappa(J) answer(s) declined", r.stderr)
        self.assert_same_report(r.stdout, doc)
        # The accurate default method answers every head at the same scale: exit 0, no nan.
        r = run("analyze", self.model, *self.args, "--scale", 30, "--format", "json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(self.declined_in(json.loads(r.stdout)), [])
        if MPI_EXE is not None:
            r = mpirun(2, "analyze", self.model, *self.args, *extra, "--format", "json")
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assert_same_report(r.stdout, doc)

    def test_mpi_gives_the_serial_report(self):
        if MPI_EXE is None:
            self.skipTest("spectral-cond-mpi not built (no MPI)")
        for n in (1, 2):
            with self.subTest(ranks=n):
                r = mpirun(n, "analyze", self.model, *self.args, "--format", "json")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assert_same_report(r.stdout)
        out = self.path("mpi.json")
        r = mpirun(2, "analyze", self.model, *self.args, "--format", "json", "--jobs", 2,
                   "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_same_report(self.read(out))
        # An error met by one rank is reported once, with its exit code, and nothing is written.
        r = mpirun(2, "analyze", self.bad, *self.args, "--format", "json", "--out",
                   self.path("mpi-bad.json"))
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(r.stderr.count("spectral-cond-mpi: error:"), 1, r.stderr)
        self.assertIn("layer 1 head", r.stderr)
        self.assertFalse(os.path.exists(self.path("mpi-bad.json")))
        r = mpirun(2, "analyze", self.model, *self.args)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--format json", r.stderr)


def main():
    global EXE, MPI_EXE, MPIRUN
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--mpi-exe")
    ap.add_argument("--mpirun")
    args, rest = ap.parse_known_args()
    EXE = os.path.abspath(args.exe)
    if args.mpi_exe and args.mpirun:
        MPI_EXE, MPIRUN = os.path.abspath(args.mpi_exe), args.mpirun
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
