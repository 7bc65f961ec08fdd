#!/usr/bin/env python3
"""Every command's machine-readable output, held against a committed copy (tests/data/golden/):
what the tool writes must not change unless a change means it to (then the copy is rewritten
with --write and the diff is reviewed in the commit).

Outputs: demo --format json; analyze of the demo checkpoint (weights; and --jacobian on one
head), sharded and merged; analyze of the trained MiniLM (weights; and --jacobian on layer 0,
head 0), when scripts/fetch-models has put it in the cache; verify at the default seed (2
instances per regime); kappa of a matrix and of an attention block with --bound; jacobian's
.npy and correct's safetensors (a digest of their bytes).

Compared after normalisation: "seconds" keys are dropped, the temporary directory becomes
<tmp>, and every number, in values and inside strings, is compared to 1e-9 relative (below that,
OpenBLAS kernels chosen for another CPU may round differently); the rest of every string must be
equal. Files are compared by their SHA-256.

    python test_cli_golden.py --exe spectral-cond [--models DIR] [--write]
"""
import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "data", "golden")
EXE = None
MODELS = None
WRITE = False
RTOL = 1e-9
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def normalise(o, tmp):
    if isinstance(o, dict):
        return {k: normalise(v, tmp) for k, v in o.items() if k != "seconds"}
    if isinstance(o, list):
        return [normalise(v, tmp) for v in o]
    if isinstance(o, str):
        return o.replace(tmp, "<tmp>")
    return o


def same(a, b, where="$"):
    """None when a and b agree (numbers to RTOL, strings with their numbers to RTOL), else
    where they first differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(set(a) ^ set(b))} differ"
        for k in a:
            d = same(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = same(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return None if a == b else f"{where}: {a!r} against {b!r}"
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return None if close(float(a), float(b)) else f"{where}: {a!r} against {b!r}"
    if isinstance(a, str) and isinstance(b, str):
        if NUMBER.sub("#", a) != NUMBER.sub("#", b):
            return f"{where}: {a!r} against {b!r}"
        for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
            if not close(float(x), float(y)):
                return f"{where}: {a!r} against {b!r}"
        return None
    return f"{where}: {a!r} against {b!r}"


def close(x, y):
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    return x == y or abs(x - y) <= RTOL * max(abs(x), abs(y), 1e-300)


def run(*args):
    p = subprocess.run([EXE, *args], capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr}")
    return p.stdout


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Golden(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tempfile.TemporaryDirectory()
        cls.tmp = cls.tmpdir.name
        cls.demo_dir = os.path.join(cls.tmp, "demo")
        cls.demo = json.loads(run("demo", "--format", "json", "--quiet", "--keep", cls.demo_dir))
        rng = np.random.default_rng(20261207)
        cls.inputs = {}
        for name, shape in (("M", (7, 5)), ("X", (6, 8)), ("WQ", (8, 4)), ("WK", (8, 4)),
                            ("WV", (8, 3))):
            p = os.path.join(cls.tmp, name + ".npy")
            np.save(p, rng.standard_normal(shape))
            cls.inputs[name] = p

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def check(self, name, doc):
        doc = normalise(doc, self.tmp)
        path = os.path.join(GOLDEN, name + ".json")
        if WRITE:
            os.makedirs(GOLDEN, exist_ok=True)
            with open(path, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.write("\n")
            return
        with open(path) as f:
            want = json.load(f)
        diff = same(doc, want)
        self.assertIsNone(diff, f"{name}: differs from tests/data/golden/{name}.json at {diff}")

    def test_demo(self):
        self.check("demo", self.demo)

    def test_analyze_demo_checkpoint_and_merge(self):
        ckpt = self.demo_dir
        self.check("analyze_demo", json.loads(run("analyze", ckpt, "--format", "json",
                                                  "--quiet")))
        args = ["analyze", ckpt, "--jacobian", "--layers", "0,11", "--jacobian-heads", "0",
                "--tokens", "24", "--format", "json", "--quiet", "--jobs", "1"]
        whole = json.loads(run(*args))
        self.check("analyze_demo_jacobian", whole)
        shards = []
        for i in range(2):
            p = os.path.join(self.tmp, f"shard{i}.json")
            run(*args, "--shard", f"{i}/2", "--out", p)
            shards.append(p)
        merged = json.loads(run("merge", *shards))
        self.assertIsNone(same(normalise(merged, self.tmp), normalise(whole, self.tmp)))

    def test_analyze_minilm(self):
        model = os.path.join(MODELS or "", "minilm-l6")
        if not (MODELS and os.path.isdir(model)):
            self.skipTest("the MiniLM is not in the model cache (scripts/fetch-models)")
        self.check("analyze_minilm", json.loads(run("analyze", model, "--format", "json",
                                                    "--quiet")))
        self.check("analyze_minilm_jacobian", json.loads(run(
            "analyze", model, "--jacobian", "--layers", "0", "--jacobian-heads", "0",
            "--tokens", "16", "--format", "json", "--quiet", "--jobs", "1")))

    def test_verify_default_seed(self):
        self.check("verify", json.loads(run("verify", "--instances-per-regime", "2",
                                            "--format", "json", "--quiet")))

    def test_kappa(self):
        i = self.inputs
        self.check("kappa_matrix", json.loads(run("kappa", "--matrix", i["M"], "--format",
                                                  "json")))
        self.check("kappa_attention", json.loads(run(
            "kappa", "--x", i["X"], "--wq", i["WQ"], "--wk", i["WK"], "--wv", i["WV"],
            "--bound", "--format", "json")))

    def test_jacobian_and_correct_files(self):
        i = self.inputs
        out = os.path.join(self.tmp, "J.npy")
        run("jacobian", "--x", i["X"], "--wq", i["WQ"], "--wk", i["WK"], "--wv", i["WV"],
            "--out", out)
        corrected = os.path.join(self.tmp, "corrected.safetensors")
        run("correct", os.path.join(self.demo_dir, "model.safetensors"), "--method", "lambda",
            "--lambda", "1", "--out", corrected, "--quiet")
        self.check("files", {"jacobian.npy": digest(out),
                             "correct.safetensors": digest(corrected)})


def main():
    global EXE, MODELS, WRITE
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--models", default=os.environ.get(
        "SPECTRAL_COND_MODELS", os.path.expanduser("~/.cache/spectral_cond/models")))
    ap.add_argument("--write", action="store_true", help="rewrite the committed copies")
    a, rest = ap.parse_known_args()
    EXE, MODELS, WRITE = a.exe, a.models, a.write
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
