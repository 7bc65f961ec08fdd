#!/usr/bin/env python3
"""`spectral-cond analyze` and `correct` on checkpoints, against numpy.

* every layout (torch-mha, timm, hf-bert, gpt2, llama with grouped-query heads) written as
  safetensors (F64, F32, F16, BF16), .npz (stored and compressed), a directory of .npy files and
  a sharded checkpoint with an index: every sigma and kappa of `analyze --format json` (whole
  projections and, with --per-head, every head's block; after lambda I_k in both placements and
  after the exact correction) against numpy.linalg.svd of the same values upcast to double,
  relative error <= 1e-10;
* heads from --heads or a config.json beside the checkpoint;
* --jacobian with --inputs against `spectral-cond jacobian` + numpy's SVD, and the seeded
  synthetic tokens (deterministic);
* `correct` then `analyze`: exact gives kappa = 2 s1 / (s1 + sr) per matrix (or per head), lambda
  satisfies the Weyl bound; every untouched tensor is byte-identical, the metadata is kept, the
  modified tensors keep their dtype; refuses to overwrite its input (same path, symlink,
  hard link);
* streaming: a shard holding only non-attention tensors is never opened (it is garbage);
* the bad-file corpus (make_bad_files.py): exit code 2, one line on stderr naming the file.

Run by ctest:  python test_cli_checkpoints.py --exe spectral-cond
"""
import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_bad_files  # noqa: E402

EXE = None
SEED = 20261201
RTOL = 1e-10
TIMEOUT = 120


def run(*args, timeout=TIMEOUT):
    return subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def analyze_json(*args):
    r = run("analyze", *args, "--format", "json", "--quiet")
    if r.returncode != 0:
        raise AssertionError(f"analyze {args} failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)


def num(x):
    return float(x) if not isinstance(x, str) else float(x.replace("nan", "nan"))


# ---------------------------------------------------------------------------------------------
# Checkpoints of every layout, and the projections they hold (D x width, float64).


def bf16_bits(a32):
    """float32 -> bfloat16 bits, round to nearest even."""
    u = a32.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype(np.uint16)


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def make_model(layout, rng, layers=2, D=16, heads=4, kv_heads=None, dtype=np.float64):
    """Tensors (name -> array) and, per layer, (W_Q, W_K, W_V) as stored (float64 upcast)."""
    kv_heads = kv_heads or heads
    d = D // heads
    tensors, proj = {}, []

    def w(shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    for i in range(layers):
        if layout in ("timm", "torch-mha"):
            T = w((3 * D, D))
            name = f"blocks.{i}.attn.qkv.weight" if layout == "timm" else \
                f"encoder.layers.{i}.self_attn.in_proj_weight"
            tensors[name] = T
            T64 = T.astype(np.float64)
            proj.append(tuple(T64[j * D:(j + 1) * D].T for j in range(3)))
            tensors[name.replace("weight", "bias")] = w((3 * D,))
        elif layout == "gpt2":
            T = w((D, 3 * D))
            tensors[f"h.{i}.attn.c_attn.weight"] = T
            T64 = T.astype(np.float64)
            proj.append(tuple(T64[:, j * D:(j + 1) * D] for j in range(3)))
        elif layout == "hf-bert":
            ws = []
            for n in ("query", "key", "value"):
                T = w((D, D))
                tensors[f"encoder.layer.{i}.attention.self.{n}.weight"] = T
                ws.append(T.astype(np.float64).T)
            proj.append(tuple(ws))
        elif layout == "llama":
            ws = []
            for n, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
                T = w((rows, D))
                tensors[f"model.layers.{i}.self_attn.{n}_proj.weight"] = T
                ws.append(T.astype(np.float64).T)
            proj.append(tuple(ws))
        elif layout in ("distilbert", "t5", "whisper", "albert"):
            if layout == "albert" and i > 0:
                continue  # one shared layer: layer 0's weights stand for all
            names = {
                "distilbert": lambda n: f"distilbert.transformer.layer.{i}.attention.{n[0]}_lin.weight",
                "t5": lambda n: f"encoder.block.{i}.layer.0.SelfAttention.{n[0]}.weight",
                "whisper": lambda n: f"model.encoder.layers.{i}.self_attn.{n[0]}_proj.weight",
                "albert": lambda n: ("albert.encoder.albert_layer_groups.0.albert_layers.0."
                                     f"attention.{n}.weight"),
            }[layout]
            ws = []
            for n in ("query", "key", "value"):
                T = w((D, D))
                tensors[names(n)] = T
                ws.append(T.astype(np.float64).T)
            proj.append(tuple(ws))
        elif layout in ("gpt-neox", "falcon"):
            # One [(H + 2G) d, D] tensor: G groups of H/G query blocks, one key and one value
            # block (GPT-NeoX: G = H, so per head q, k, v).
            r = heads // kv_heads
            T = w(((heads + 2 * kv_heads) * d, D))
            name = (f"gpt_neox.layers.{i}.attention.query_key_value.weight" if layout == "gpt-neox"
                    else f"transformer.h.{i}.self_attention.query_key_value.weight")
            tensors[name] = T
            G = T.astype(np.float64).reshape(kv_heads, r + 2, d, D)
            WQ = np.concatenate([G[g, j].T for g in range(kv_heads) for j in range(r)], axis=1)
            WK = np.concatenate([G[g, r].T for g in range(kv_heads)], axis=1)
            WV = np.concatenate([G[g, r + 1].T for g in range(kv_heads)], axis=1)
            proj.append((WQ, WK, WV))
        tensors[f"layers_extra.{i}.mlp.fc1.weight"] = w((2 * D, D))
    return tensors, proj


def write_bf16_safetensors(path, tensors, metadata=None):
    """A safetensors file with every float tensor stored as BF16 (raw bytes)."""
    header, chunks, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        b = bf16_bits(tensors[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    js = json.dumps(header).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js + b"".join(chunks))


def read_safetensors_raw(path):
    """(metadata, {name: (dtype, shape, bytes)}) parsed independently of the tool."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    meta = h.pop("__metadata__", {})
    base = 8 + n
    return meta, {k: (v["dtype"], v["shape"], raw[base + v["data_offsets"][0]:
                                                  base + v["data_offsets"][1]])
                  for k, v in h.items()}


def decode(dtype, shape, b):
    if dtype == "BF16":
        return bf16_values(np.frombuffer(b, dtype="<u2")).reshape(shape)
    npd = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}[dtype]
    return np.frombuffer(b, dtype=npd).astype(np.float64).reshape(shape)


# ---------------------------------------------------------------------------------------------
# numpy's answers.


def sv(W):
    return np.linalg.svd(W, compute_uv=False)


def expected_matrix(W, lam, heads, d, isometric_per_head, fused_slice=None):
    """The fields analyze reports for one projection (or head block) W. For a head block,
    fused_slice is that head's columns of the fused identity I(D, h d)."""
    D, width = W.shape
    s = sv(W)
    Ef = np.eye(D, width) if fused_slice is None else fused_slice
    Ep = np.hstack([np.eye(D, d)] * heads) if not isometric_per_head else np.eye(D, width)
    U, S, Vt = np.linalg.svd(W, full_matrices=False)
    exact = sv(W + S[0] * U @ Vt)
    f, p = sv(W + lam * Ef), sv(W + lam * Ep)
    return {"sigma_max": s[0], "sigma_min": s[-1], "kappa": s[0] / s[-1],
            "fused": (f[0], f[-1], f[0] / f[-1]), "per_head": (p[0], p[-1], p[0] / p[-1]),
            "exact": exact[0] / exact[-1], "predicted": 2 * S[0] / (S[0] + S[-1])}


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="sc_ckpt_")
        cls.dir = cls.tmp.name
        print(f"[test_cli_checkpoints] seed {SEED}", file=sys.stderr)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, *names):
        p = os.path.join(self.dir, *names)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def close(self, got, want, what, rtol=RTOL):
        got = num(got)
        self.assertTrue(abs(got - want) <= rtol * abs(want),
                        f"{what}: got {got!r}, numpy {want!r}, rel {abs(got - want) / abs(want):.2e}")

    def check_matrix(self, m, W, lam, heads, d, whole, what, rtol=RTOL, fused_slice=None):
        e = expected_matrix(W, lam, heads, d, isometric_per_head=not whole or heads == 1,
                            fused_slice=fused_slice)
        self.assertEqual(m["shape"], list(W.shape), what)
        self.close(m["sigma_max"], e["sigma_max"], what + " sigma_max", rtol)
        self.close(m["sigma_min"], e["sigma_min"], what + " sigma_min", rtol)
        self.close(m["kappa"], e["kappa"], what + " kappa", rtol)
        for key, val in (("lambda_fused", e["fused"]), ("lambda_per_head", e["per_head"])):
            self.close(m[key]["sigma_max"], val[0], f"{what} {key} sigma_max", rtol)
            self.close(m[key]["sigma_min"], val[1], f"{what} {key} sigma_min", rtol)
            self.close(m[key]["kappa"], val[2], f"{what} {key} kappa", rtol)
        self.close(m["exact"]["kappa"], e["exact"], what + " exact kappa", rtol)
        self.close(m["exact"]["predicted"], e["predicted"], what + " exact predicted", rtol)
        self.close(m["exact"]["kappa"], e["predicted"], what + " exact = 2s1/(s1+sr)", 1e-9)
        # Weyl: a theorem when lambda > s and the addend is an isometry.
        s = e["sigma_max"]
        if lam > s:
            self.assertTrue(m["lambda_fused"]["weyl_applies"], what)
            self.close(m["lambda_fused"]["weyl_bound"], (lam + s) / (lam - s), what + " weyl")
            self.assertLessEqual(num(m["lambda_fused"]["kappa"]),
                                 (lam + s) / (lam - s) * (1 + 1e-12), what)
        if whole and heads > 1:
            self.assertFalse(m["lambda_per_head"]["weyl_applies"], what)

    def check_report(self, rep, proj, heads, kv_heads, lam=10.0, per_head=True, rtol=RTOL):
        self.assertEqual(len(rep["layers"]), len(proj))
        for L, (WQ, WK, WV) in zip(rep["layers"], proj):
            D = WQ.shape[0]
            d = WQ.shape[1] // heads
            dv = WV.shape[1] // kv_heads
            self.assertEqual((L["heads"], L["kv_heads"], L["d_k"], L["d_v"]),
                             (heads, kv_heads, d, dv))
            i = L["index"]
            self.check_matrix(L["W_Q"], WQ, lam, heads, d, True, f"layer {i} W_Q", rtol)
            self.check_matrix(L["W_K"], WK, lam, kv_heads, d, True, f"layer {i} W_K", rtol)
            self.check_matrix(L["W_V"], WV, lam, kv_heads, dv, True, f"layer {i} W_V", rtol)
            if not per_head:
                continue
            self.assertEqual(len(L["per_head"]), heads)
            for H in L["per_head"]:
                h, g = H["head"], H["kv_head"]
                self.assertEqual(g, h // (heads // kv_heads))
                def sl(W, j, w):  # head j's columns of W and of the fused identity
                    return W[:, j * w:(j + 1) * w], np.eye(D, W.shape[1])[:, j * w:(j + 1) * w]
                for name, W, j, w in (("W_Q", WQ, h, d), ("W_K", WK, g, d), ("W_V", WV, g, dv)):
                    B, E = sl(W, j, w)
                    self.check_matrix(H[name], B, lam, 1, w, False, f"layer {i} head {h} {name}",
                                      rtol, fused_slice=E)
                # fused placement for head h: the h-th slice of I(D, width)
                f = sv(WQ[:, h * d:(h + 1) * d] + lam * np.eye(D, WQ.shape[1])[:, h * d:(h + 1) * d])
                self.close(H["W_Q"]["lambda_fused"]["kappa"], f[0] / f[-1],
                           f"layer {i} head {h} fused slice")


# ---------------------------------------------------------------------------------------------


class TestAnalyzeLayouts(Base):
    LAYOUTS = [("timm", 4, None), ("torch-mha", 4, None), ("hf-bert", 2, None),
               ("gpt2", 4, None), ("llama", 4, 2), ("distilbert", 2, None), ("t5", 2, None),
               ("whisper", 4, None), ("albert", 2, None), ("gpt-neox", 4, None),
               ("falcon", 4, 2), ("falcon", 4, 1)]

    def test_safetensors_f64_every_layout(self):
        rng = np.random.default_rng(SEED)
        for layout, heads, kv in self.LAYOUTS:
            with self.subTest(layout=layout):
                t, proj = make_model(layout, rng, heads=heads, kv_heads=kv)
                p = self.path("f64", f"{layout}-{kv}", "model.safetensors")
                save_file(t, p, metadata={"format": "np"})
                args = ["--heads", heads] + (["--kv-heads", kv] if kv else [])
                doc = analyze_json(p, *args, "--per-head")
                rep = doc["checkpoints"][0]
                self.assertEqual(rep["layout"], layout)
                self.assertEqual(rep["source"], "safetensors")
                self.check_report(rep, proj, heads, kv or heads)
                # explicit --layout gives the same numbers
                doc2 = analyze_json(p, *args, "--per-head", "--layout", layout)
                self.assertEqual(doc2["checkpoints"][0]["layers"], rep["layers"])

    def test_npz_and_npy_dir(self):
        rng = np.random.default_rng(SEED + 1)
        for layout, heads, kv in self.LAYOUTS:
            with self.subTest(layout=layout):
                t, proj = make_model(layout, rng, heads=heads, kv_heads=kv, dtype=np.float32)
                args = ["--heads", heads] + (["--kv-heads", kv] if kv else [])
                p = self.path("npz", f"{layout}-{kv}.npz")
                np.savez(p, **t)
                rep = analyze_json(p, *args, "--per-head")["checkpoints"][0]
                self.assertEqual(rep["source"], "npz")
                self.check_report(rep, proj, heads, kv or heads)
                pc = self.path("npz", f"{layout}-{kv}_c.npz")
                np.savez_compressed(pc, **t)
                repc = analyze_json(pc, *args, "--per-head")["checkpoints"][0]
                self.assertEqual(repc["layers"], rep["layers"])
                dd = self.path("npydir", f"{layout}-{kv}", "x")[:-2]
                for k, v in t.items():
                    # some arrays in Fortran order: the reader must honour the flag
                    np.save(os.path.join(dd, k + ".npy"), np.asfortranarray(v) if "k" in k else v)
                repd = analyze_json(dd, *args, "--per-head")["checkpoints"][0]
                self.assertEqual(repd["source"], "npy-dir")
                self.assertEqual(repd["layers"], rep["layers"])

    def test_f32_f16_bf16(self):
        rng = np.random.default_rng(SEED + 2)
        t, _ = make_model("timm", rng, heads=4, dtype=np.float64)
        for name, conv in (("F32", lambda a: a.astype(np.float32)),
                           ("F16", lambda a: a.astype(np.float16))):
            with self.subTest(dtype=name):
                tt = {k: conv(v) for k, v in t.items()}
                p = self.path("dt", name + ".safetensors")
                save_file(tt, p)
                T = tt["blocks.0.attn.qkv.weight"].astype(np.float64)
                rep = analyze_json(p, "--heads", 4, "--per-head")["checkpoints"][0]
                proj = [tuple(tt[f"blocks.{i}.attn.qkv.weight"].astype(np.float64)[j * 16:(j + 1) * 16].T
                              for j in range(3)) for i in range(2)]
                self.assertEqual(rep["layers"][0]["W_Q"]["dtype"], name)
                self.check_report(rep, proj, 4, 4)
                del T
        with self.subTest(dtype="BF16"):
            p = self.path("dt", "BF16.safetensors")
            write_bf16_safetensors(p, t)
            proj = [tuple(bf16_values(bf16_bits(t[f"blocks.{i}.attn.qkv.weight"])).reshape(48, 16)
                          [j * 16:(j + 1) * 16].T for j in range(3)) for i in range(2)]
            rep = analyze_json(p, "--heads", 4, "--per-head")["checkpoints"][0]
            self.assertEqual(rep["layers"][0]["W_Q"]["dtype"], "BF16")
            self.check_report(rep, proj, 4, 4)

    def test_config_json_heads_and_gqa(self):
        rng = np.random.default_rng(SEED + 3)
        t, proj = make_model("llama", rng, heads=4, kv_heads=2, dtype=np.float32)
        p = self.path("cfg", "model.safetensors")
        save_file(t, p)
        # no heads anywhere: a clear error
        r = run("analyze", p, "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--heads", r.stderr)
        with open(self.path("cfg", "config.json"), "w") as f:
            json.dump({"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16}, f)
        rep = analyze_json(p, "--per-head")["checkpoints"][0]
        self.assertTrue(rep["heads_from"].endswith("config.json"))
        self.check_report(rep, proj, 4, 2)
        # the directory is accepted too
        rep2 = analyze_json(self.path("cfg", "x")[:-2])["checkpoints"][0]
        self.assertEqual(rep2["layers"][1]["W_K"], rep["layers"][1]["W_K"])
        # a config that contradicts the tensors
        with open(self.path("cfg", "config.json"), "w") as f:
            json.dump({"num_attention_heads": 4, "hidden_size": 32}, f)
        r = run("analyze", p, "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)

    def test_layers_lambda_formats_out(self):
        rng = np.random.default_rng(SEED + 4)
        t, proj = make_model("timm", rng, layers=8, heads=2)
        p = self.path("sel", "model.safetensors")
        save_file(t, p)
        rep = analyze_json(p, "--heads", 2, "--layers", "0,3,5-6", "--lambda", 0.5)["checkpoints"][0]
        self.assertEqual([L["index"] for L in rep["layers"]], [0, 3, 5, 6])
        self.check_report(rep, [proj[i] for i in (0, 3, 5, 6)], 2, 2, lam=0.5, per_head=False)
        r = run("analyze", p, "--heads", 2, "--layers", "9", "--quiet")
        self.assertEqual(r.returncode, 2)
        self.assertIn("9", r.stderr)
        r = run("analyze", p, "--heads", 2, "--format", "csv", "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.strip().splitlines()
        self.assertTrue(lines[0].startswith("checkpoint,layer,head,kv_head,matrix,tensor"))
        self.assertEqual(len(lines), 1 + 8 * 3)
        row = dict(zip(lines[0].split(","), lines[1].split(",")))
        self.close(row["kappa"], sv(proj[0][0])[0] / sv(proj[0][0])[-1], "csv kappa")
        r = run("analyze", p, "--heads", 2, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("kappa", r.stdout)
        out = self.path("sel", "report.json")
        r = run("analyze", p, "--heads", 2, "--format", "json", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        with open(out) as f:
            self.assertEqual(json.load(f)["format_version"], 2)
        self.assertEqual([n for n in os.listdir(self.path("sel", "x")[:-2]) if ".tmp." in n], [])

    def test_device(self):
        rng = np.random.default_rng(SEED + 5)
        t, _ = make_model("timm", rng, layers=1, heads=2)
        p = self.path("dev", "model.safetensors")
        save_file(t, p)
        # --device acts on the Jacobian analysis only: without --jacobian it is refused.
        r = run("analyze", p, "--heads", 2, "--device", "cuda", "--quiet")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--device needs --jacobian", r.stderr)
        r = run("analyze", p, "--heads", 2, "--jacobian", "--device", "cuda", "--quiet")
        if r.returncode != 0:
            self.assertEqual(r.returncode, 2)
            self.assertIn("built without CUDA", r.stderr)
            self.assertIn("-DSPECTRAL_COND_ENABLE_CUDA=ON", r.stderr)


class TestSharded(Base):
    def write_sharded(self, root, garbage_shard=False):
        rng = np.random.default_rng(SEED + 10)
        t, proj = make_model("llama", rng, layers=3, heads=4, kv_heads=2, dtype=np.float32)
        attn = {k: v for k, v in t.items() if "self_attn" in k}
        other = {k: v for k, v in t.items() if "self_attn" not in k}
        names = sorted(attn)
        shards = {"model-00001-of-00003.safetensors": {k: attn[k] for k in names[: len(names) // 2]},
                  "model-00002-of-00003.safetensors": {k: attn[k] for k in names[len(names) // 2:]},
                  "model-00003-of-00003.safetensors": other}
        wm = {}
        for fname, ts in shards.items():
            save_file(ts, os.path.join(root, fname), metadata={"format": "pt"})
            wm.update({k: fname for k in ts})
        with open(os.path.join(root, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, f)
        if garbage_shard:
            with open(os.path.join(root, "model-00003-of-00003.safetensors"), "wb") as f:
                f.write(b"\xff" * 64)
        return t, proj

    def test_sharded_matches_single(self):
        root = self.path("sharded", "x")[:-2]
        t, proj = self.write_sharded(root)
        rep = analyze_json(os.path.join(root, "model.safetensors.index.json"), "--heads", 4,
                           "--kv-heads", 2, "--per-head")["checkpoints"][0]
        self.check_report(rep, proj, 4, 2)
        rep_dir = analyze_json(root, "--heads", 4, "--kv-heads", 2, "--per-head")["checkpoints"][0]
        self.assertEqual(rep_dir["layers"], rep["layers"])

    def test_a_bad_shard_is_refused_at_the_start_even_without_attention(self):
        """Every shard's header is checked when the checkpoint is opened (tensor data is still
        read only where it is used): a truncated or foreign shard is an error naming it, even
        when it holds no attention tensor, for analyze (whole or one layer) and correct."""
        root = self.path("stream", "x")[:-2]
        self.write_sharded(root, garbage_shard=True)
        idx = os.path.join(root, "model.safetensors.index.json")
        for extra in ([], ["--layers", "0"]):
            r = run("analyze", idx, "--heads", 4, "--kv-heads", 2, "--quiet", *extra)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("model-00003-of-00003.safetensors", r.stderr)
        r = run("correct", idx, "--heads", 4, "--kv-heads", 2, "--method", "lambda", "--out",
                self.path("stream_out.safetensors"), "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("model-00003-of-00003.safetensors", r.stderr)


class TestCorrect(Base):
    def tensors_equal_except(self, a, b, changed):
        ma, ta = read_safetensors_raw(a)
        mb, tb = read_safetensors_raw(b)
        self.assertEqual(ma, mb)
        self.assertEqual(sorted(ta), sorted(tb))
        for k in ta:
            self.assertEqual(ta[k][0], tb[k][0], k)  # dtype kept
            self.assertEqual(ta[k][1], tb[k][1], k)
            same = hashlib.sha256(ta[k][2]).digest() == hashlib.sha256(tb[k][2]).digest()
            self.assertEqual(same, k not in changed, k)
        return ta, tb

    def test_exact_and_lambda_every_layout(self):
        rng = np.random.default_rng(SEED + 20)
        for layout, heads, kv in TestAnalyzeLayouts.LAYOUTS:
            t, proj = make_model(layout, rng, heads=heads, kv_heads=kv)
            src = self.path("corr", layout, "model.safetensors")
            save_file(t, src, metadata={"format": "pt", "note": "keep me"})
            args = ["--heads", heads] + (["--kv-heads", kv] if kv else [])
            attn = {k for k in t if "mlp" not in k and "bias" not in k}
            for method, placement in (("exact", "fused"), ("exact", "per-head"),
                                      ("lambda", "fused"), ("lambda", "per-head")):
                with self.subTest(layout=layout, method=method, placement=placement):
                    out = self.path("corr", layout, f"{method}_{placement}.safetensors")
                    r = run("correct", src, *args, "--method", method, "--placement", placement,
                            "--out", out, "--quiet")
                    self.assertEqual(r.returncode, 0, r.stderr)
                    self.tensors_equal_except(src, out, attn)
                    rep = analyze_json(out, *args, "--per-head")["checkpoints"][0]
                    for L, W3 in zip(rep["layers"], proj):
                        for role, W, nh in (("W_Q", W3[0], heads), ("W_K", W3[1], kv or heads),
                                            ("W_V", W3[2], kv or heads)):
                            d = W.shape[1] // nh
                            if method == "exact" and placement == "fused":
                                s = sv(W)
                                self.close(L[role]["kappa"], 2 * s[0] / (s[0] + s[-1]),
                                           f"{layout} {role} exact", 1e-9)
                            elif method == "exact":
                                for H in L["per_head"]:
                                    g = H["head"] if role == "W_Q" else H["kv_head"]
                                    s = sv(W[:, g * d:(g + 1) * d])
                                    self.close(H[role]["kappa"], 2 * s[0] / (s[0] + s[-1]),
                                               f"{layout} {role} head {g} exact", 1e-9)
                            elif placement == "fused":
                                s1 = sv(W)[0]
                                f = sv(W + 10 * np.eye(*W.shape))
                                self.close(L[role]["kappa"], f[0] / f[-1], f"{layout} {role} lambda")
                                self.assertLessEqual(f[0] / f[-1], (10 + s1) / (10 - s1))
                            else:
                                for H in L["per_head"]:
                                    g = H["head"] if role == "W_Q" else H["kv_head"]
                                    B = W[:, g * d:(g + 1) * d]
                                    s1 = sv(B)[0]
                                    k = num(H[role]["kappa"])
                                    f = sv(B + 10 * np.eye(*B.shape))
                                    self.close(k, f[0] / f[-1], f"{layout} {role} head {g}")
                                    self.assertLessEqual(k, (10 + s1) / (10 - s1) * (1 + 1e-12))

    def test_packed_and_subset_placements(self):
        """--placement packed adds lam eye to the packed tensor as stored (output feature f gains
        lam at input f, f < D: the diagonal in both Linear and Conv1D storage); it is refused on
        separate Q/K/V tensors and with --method exact; fused:qk leaves W_V's bytes alone."""
        rng = np.random.default_rng(SEED + 23)
        lam = 2.5
        for layout, heads, kv in (("timm", 4, None), ("gpt2", 4, None), ("gpt-neox", 4, None),
                                  ("falcon", 4, 1), ("llama", 4, 2)):
            with self.subTest(layout=layout):
                t, _ = make_model(layout, rng, heads=heads, kv_heads=kv)
                src = self.path("pk", layout, "model.safetensors")
                save_file(t, src)
                args = ["--heads", heads] + (["--kv-heads", kv] if kv else [])
                out = self.path("pk", layout, "packed.safetensors")
                r = run("correct", src, *args, "--method", "lambda", "--lambda", lam,
                        "--placement", "packed", "--out", out, "--quiet")
                packed = {k for k in t if "mlp" not in k and "bias" not in k}
                if layout == "llama":  # separate q_proj, k_proj, v_proj
                    self.assertEqual(r.returncode, 2, r.stderr)
                    self.assertIn("--placement packed", r.stderr)
                    self.assertIn("separate", r.stderr)
                    self.assertFalse(os.path.exists(out))
                    continue
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIn("placement packed", r.stdout)
                _, tb = self.tensors_equal_except(src, out, packed)
                for k in packed:
                    self.assertTrue(np.array_equal(decode(*tb[k]),
                                                   t[k] + lam * np.eye(*t[k].shape)), k)
        # exact has no packed reading
        r = run("correct", src, "--heads", 4, "--method", "exact", "--placement", "packed",
                "--out", self.path("pk", "exact.safetensors"), "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--placement packed applies to --method lambda", r.stderr)
        for bad in ("diagonal", "fused:qq", "packed:q", "per-head:"):
            r = run("correct", src, "--heads", 4, "--method", "lambda", "--placement", bad,
                    "--out", self.path("pk", "bad.safetensors"), "--quiet")
            self.assertEqual(r.returncode, 2, (bad, r.stderr))
            self.assertIn("--placement", r.stderr)
        # a subset: W_Q and W_K of a llama layer (separate tensors) corrected, W_V untouched
        t, _ = make_model("llama", rng, heads=4, kv_heads=2)
        src = self.path("pk", "sub", "model.safetensors")
        save_file(t, src)
        for placement, d in (("fused:qk", None), ("per-head:qk", 4)):
            out = self.path("pk", "sub", placement.replace(":", "_") + ".safetensors")
            r = run("correct", src, "--heads", 4, "--kv-heads", 2, "--method", "lambda",
                    "--lambda", lam, "--placement", placement, "--out", out, "--quiet")
            self.assertEqual(r.returncode, 0, r.stderr)
            changed = {k for k in t if "q_proj" in k or "k_proj" in k}
            _, tb = self.tensors_equal_except(src, out, changed)
            for k in changed:
                W = t[k].T  # D x width
                E = np.eye(*W.shape) if d is None else np.hstack([np.eye(W.shape[0], d)] *
                                                                  (W.shape[1] // d))
                self.assertTrue(np.array_equal(decode(*tb[k]).T, W + lam * E), (placement, k))

    def test_target_and_dtypes(self):
        rng = np.random.default_rng(SEED + 21)
        t, proj = make_model("timm", rng, heads=2)
        src = self.path("tgt", "model.safetensors")
        save_file(t, src)
        out = self.path("tgt", "out.safetensors")
        r = run("correct", src, "--heads", 2, "--method", "exact", "--target", 1.5, "--out", out,
                "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        rep = analyze_json(out, "--heads", 2)["checkpoints"][0]
        for L in rep["layers"]:
            for role in ("W_Q", "W_K", "W_V"):
                self.close(L[role]["kappa"], 1.5, "target", 1e-9)
        # BF16 and F16 inputs: modified tensors keep their dtype, the rest is byte-identical
        for dt in ("BF16", "F16"):
            with self.subTest(dtype=dt):
                p = self.path("tgt", dt + ".safetensors")
                if dt == "BF16":
                    write_bf16_safetensors(p, t, metadata={"format": "pt"})
                else:
                    save_file({k: v.astype(np.float16) for k, v in t.items()}, p,
                              metadata={"format": "pt"})
                o = self.path("tgt", dt + "_out.safetensors")
                r = run("correct", p, "--heads", 2, "--method", "lambda", "--lambda", 4, "--out",
                        o, "--quiet")
                self.assertEqual(r.returncode, 0, r.stderr)
                ta, tb = self.tensors_equal_except(p, o, {k for k in t if "qkv.weight" in k})
                for k in t:
                    if "qkv.weight" not in k:
                        continue
                    W = decode(*ta[k])
                    got = decode(*tb[k])
                    want = W + 4 * np.vstack([np.eye(16)] * 3)
                    # the correction is rounded once to the dtype
                    ulp = 2.0 ** -8 if dt == "BF16" else 2.0 ** -11
                    self.assertTrue(np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-30), k)

    def test_npz_input(self):
        rng = np.random.default_rng(SEED + 22)
        t, proj = make_model("gpt2", rng, heads=2, dtype=np.float32)
        src = self.path("npzc", "model.npz")
        np.savez(src, **t)
        out = self.path("npzc", "out.safetensors")
        r = run("correct", src, "--heads", 2, "--method", "exact", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        _, tb = read_safetensors_raw(out)
        for k, v in t.items():
            self.assertEqual(tb[k][0], "F32")
            if "c_attn" not in k:
                self.assertEqual(tb[k][2], v.astype("<f4").tobytes(), k)
        rep = analyze_json(out, "--heads", 2)["checkpoints"][0]
        for L, W3 in zip(rep["layers"], proj):
            s = sv(W3[0])
            self.close(L["W_Q"]["kappa"], 2 * s[0] / (s[0] + s[-1]), "npz exact", 1e-5)

    def test_sharded_input_single_output(self):
        root = self.path("shc", "x")[:-2]
        t, proj = TestSharded.write_sharded(self, root)
        out = self.path("shc_out.safetensors")
        r = run("correct", root, "--heads", 4, "--kv-heads", 2, "--method", "exact", "--out", out,
                "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        meta, tb = read_safetensors_raw(out)
        self.assertEqual(meta, {"format": "pt"})
        self.assertEqual(sorted(tb), sorted(t))
        for k, v in t.items():
            if "self_attn" not in k:
                self.assertEqual(tb[k][2], v.astype("<f4").tobytes(), k)

    def test_refuses_to_overwrite_input(self):
        rng = np.random.default_rng(SEED + 23)
        t, _ = make_model("timm", rng, heads=2)
        src = self.path("ovw", "model.safetensors")
        save_file(t, src)
        with open(src, "rb") as f:
            before = hashlib.sha256(f.read()).hexdigest()
        link = self.path("ovw", "link.safetensors")
        os.symlink(src, link)
        hard = self.path("ovw", "hard.safetensors")
        os.link(src, hard)
        for out in (src, link, hard, self.path("ovw", ".", "model.safetensors")):
            with self.subTest(out=out):
                r = run("correct", src, "--heads", 2, "--method", "lambda", "--out", out, "--quiet")
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("refusing to overwrite", r.stderr)
                self.assertEqual(len(r.stderr.strip().splitlines()), 1)
        with open(src, "rb") as f:
            self.assertEqual(hashlib.sha256(f.read()).hexdigest(), before)
        r = run("correct", link, "--heads", 2, "--method", "lambda", "--out", src, "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)


    def test_correct_copies_npz_members_as_stored_not_as_doubles(self):
        # A compressed .npz of about 0.1 MB whose float16 member inflates to 64 MiB: correct
        # copies its stored bytes (one 64 MiB buffer); read as doubles it peaked above 320 MiB.
        rng = np.random.default_rng(SEED + 24)
        t, _ = make_model("timm", rng, layers=1, heads=2, dtype=np.float16)
        t["big"] = np.zeros((4096, 8192), dtype=np.float16)
        t["big"][7, 11] = 1.5
        t["fo"] = np.asfortranarray(np.arange(6, dtype="<f8").reshape(2, 3))  # Fortran order
        src = self.path("npzmem", "model.npz")
        np.savez_compressed(src, **t)
        self.assertLess(os.path.getsize(src), 1 << 20)
        out = self.path("npzmem", "out.safetensors")
        probe = ("import resource, subprocess, sys; "
                 "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                 "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
                 "print(r.stderr, file=sys.stderr)")
        cmd = [EXE, "correct", src, "--heads", "2", "--method", "lambda", "--out", out, "--quiet"]
        r = subprocess.run([sys.executable, "-c", probe, *cmd],
                           capture_output=True, text=True, timeout=TIMEOUT)
        rc, peak_kb = map(int, r.stdout.split())
        self.assertEqual(rc, 0, r.stderr)
        self.assertLess(peak_kb * 1024, 160 << 20, f"peak RSS {peak_kb} kB")
        from safetensors.numpy import load_file
        got = load_file(out)
        self.assertEqual(got["big"].dtype, np.float16)
        self.assertTrue(np.array_equal(got["big"], t["big"]))
        self.assertTrue(np.array_equal(got["fo"], np.ascontiguousarray(t["fo"])))
        # Under a memory budget below what it must hold (the 64 MiB member, stored as float16):
        # refused before any work, exit 2 naming the file and the sizes, nothing written. The
        # estimate counts the member's bytes (2 x 4096 x 8192), so a budget just above passes.
        refused = self.path("npzmem", "refused.safetensors")
        need = 2 * 4096 * 8192
        for budget, rc in ((need // 2, 2), (need + (8 << 20), 0)):
            with self.subTest(budget=budget):
                r = subprocess.run([*cmd[:-2], refused, "--quiet"], capture_output=True, text=True,
                                   timeout=TIMEOUT,
                                   env=dict(os.environ, SPECTRAL_COND_MEMORY_BUDGET=str(budget)))
                self.assertEqual(r.returncode, rc, r.stderr)
                if rc == 2:
                    self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
                    self.assertIn(src, r.stderr)
                    self.assertIn("memory budget", r.stderr)
                    self.assertEqual([f for f in os.listdir(os.path.dirname(refused))
                                      if f.startswith("refused")], [])
                else:
                    self.assertTrue(os.path.exists(refused))


class TestJacobian(Base):
    def test_inputs_against_jacobian_command(self):
        rng = np.random.default_rng(SEED + 30)
        t, proj = make_model("timm", rng, layers=2, D=8, heads=2)
        p = self.path("jac", "model.safetensors")
        save_file(t, p)
        X = rng.standard_normal((5, 8))
        xp = self.path("jac", "X.npy")
        np.save(xp, X)
        # --no-biases: the `jacobian` command's block is the one without the qkv bias.
        rep = analyze_json(p, "--heads", 2, "--jacobian", "--inputs", xp, "--method", "dense",
                           "--layers", "1", "--no-biases")["checkpoints"][0]
        L = rep["layers"][0]
        self.assertEqual(len(L["jacobian"]), 2)
        WQ, WK, WV = proj[1]
        for J in L["jacobian"]:
            h = J["head"]
            ws = [W[:, h * 4:(h + 1) * 4] for W in (WQ, WK, WV)]
            files = []
            for n, W in zip("qkv", ws):
                files.append(self.path("jac", f"w{n}{h}.npy"))
                np.save(files[-1], W)
            jp = self.path("jac", f"J{h}.npy")
            r = run("jacobian", "--x", xp, "--wq", files[0], "--wk", files[1], "--wv", files[2],
                    "--out", jp)
            self.assertEqual(r.returncode, 0, r.stderr)
            s = sv(np.load(jp))
            self.close(J["J"]["sigma_max"], s[0], f"head {h} sigma_max(J)", 1e-9)
            self.close(J["J"]["kappa"], s[0] / s[-1], f"head {h} kappa(J)", 1e-8)
            th = J["theorem34"]
            sx = sv(X)
            self.close(th["kappa_X"]["kappa"], sx[0] / sx[-1], "kappa(X)")
            sq = sv(ws[0])
            self.close(th["kappa_WQ"]["kappa"], sq[0] / sq[-1], "kappa(W_Q)")
            self.assertIn(th["holds_plus"], (True, False))
            self.assertEqual(th["kappa_Lambda"]["kappa"], "inf")
        # X must match D
        np.save(xp, rng.standard_normal((5, 7)))
        r = run("analyze", p, "--heads", 2, "--jacobian", "--inputs", xp, "--quiet")
        self.assertEqual(r.returncode, 2)
        self.assertIn(xp, r.stderr)

    def test_inputs_per_layer(self):
        # One X per layer, in an .npz keyed by index or a folder keyed by layer_<index> / prefix:
        # each layer's kappa(J) is the one a single --inputs file gives for that layer.
        rng = np.random.default_rng(SEED + 32)
        t, _ = make_model("timm", rng, layers=3, D=8, heads=2)
        p = self.path("perlayer", "model.safetensors")
        save_file(t, p)
        Xs = [rng.standard_normal((n, 8)) for n in (5, 6, 7)]
        base = ["--heads", 2, "--jacobian", "--method", "dense", "--no-jacobian-corrections"]
        single = []
        for i, X in enumerate(Xs):
            xp = self.path("perlayer", f"X{i}.npy")
            np.save(xp, X)
            single.append(analyze_json(p, *base, "--inputs", xp, "--layers", i)
                          ["checkpoints"][0]["layers"][0])
        npz = self.path("perlayer", "hidden.npz")
        np.savez(npz, **{"0": Xs[0], "layer_1": Xs[1], "blocks.2.attn": Xs[2]})
        folder = self.path("perlayer", "hidden", "x")[:-2]
        for i, X in enumerate(Xs):
            np.save(os.path.join(folder, f"layer_{i}.npy"), X)
        for src in (npz, folder):
            rep = analyze_json(p, *base, "--inputs", src)["checkpoints"][0]
            self.assertIn("one X per layer", rep["inputs"])
            for L, S in zip(rep["layers"], single):
                self.assertEqual(L["tokens"], S["tokens"])
                self.assertEqual([j["J"] for j in L["jacobian"]], [j["J"] for j in S["jacobian"]])
        self.assertEqual([L["tokens"] for L in rep["layers"]], [5, 6, 7])
        # A layer without its X is an error naming the layer and the keys looked for.
        os.remove(os.path.join(folder, "layer_1.npy"))
        r = run("analyze", p, *base, "--inputs", folder, "--quiet")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no X for layer 1 (looked for 1, layer_1, layer.1, blocks.1.attn.", r.stderr)
        # ... but not when that layer is not selected.
        self.assertEqual(run("analyze", p, *base, "--inputs", folder, "--layers", "0,2",
                             "--quiet").returncode, 0)

    def test_synthetic_tokens_deterministic(self):
        rng = np.random.default_rng(SEED + 31)
        t, _ = make_model("timm", rng, layers=1, D=8, heads=2)
        p = self.path("syn", "model.safetensors")
        save_file(t, p)
        a = analyze_json(p, "--heads", 2, "--jacobian", "--tokens", 6, "--seed", 3)
        b = analyze_json(p, "--heads", 2, "--jacobian", "--tokens", 6, "--seed", 3)
        c = analyze_json(p, "--heads", 2, "--jacobian", "--tokens", 6, "--seed", 4)
        ja = a["checkpoints"][0]["layers"][0]["jacobian"]
        self.assertEqual([j["J"] for j in ja],
                         [j["J"] for j in b["checkpoints"][0]["layers"][0]["jacobian"]])
        self.assertNotEqual(ja[0]["J"]["kappa"],
                            c["checkpoints"][0]["layers"][0]["jacobian"][0]["J"]["kappa"])
        # LayerNorm-like rows: kappa(X) of the tokens is finite, N = 6
        self.assertEqual(a["checkpoints"][0]["tokens"], 6)


class TestConfig(Base):
    def test_kv_heads_from_config_and_config_copied(self):
        rng = np.random.default_rng(SEED + 40)
        t, proj = make_model("llama", rng, heads=4, kv_heads=2)
        d = self.path("cfg", "model", "x")[:-2]
        save_file(t, os.path.join(d, "model.safetensors"))
        cfg = json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}).encode()
        with open(os.path.join(d, "config.json"), "wb") as f:
            f.write(cfg)
        # --heads alone keeps config.json's key/value head count (--help: the default).
        rep = analyze_json(d, "--heads", 4, "--per-head")["checkpoints"][0]
        self.check_report(rep, proj, 4, 2)
        # correct copies config.json beside its output, and never replaces one already there.
        out = self.path("cfg", "out", "model.safetensors")
        r = run("correct", d, "--method", "lambda", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("copied config.json", r.stdout)
        with open(os.path.join(os.path.dirname(out), "config.json"), "rb") as f:
            self.assertEqual(f.read(), cfg)
        other = self.path("cfg", "out2", "config.json")
        with open(other, "wb") as f:
            f.write(b"{}")
        r = run("correct", d, "--method", "lambda", "--out", os.path.join(os.path.dirname(other),
                                                                          "m.safetensors"), "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(other, "rb") as f:
            self.assertEqual(f.read(), b"{}")


PYTORCH_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "pytorch")


class TestPytorch(Base):
    """Checkpoints torch.save wrote (tests/data/pytorch/make_pytorch.py: zip and legacy format,
    F32 and F16) give exactly the numbers of the same values saved by numpy as .npz, which the
    tests above check against numpy's SVD; `correct` on them keeps every other tensor's bytes."""

    MODELS = (("mha_zip", "torch-mha", 2), ("bert_legacy", "hf-bert", 2),
              ("llama_f16", "llama", 4))

    def test_analyze_matches_npz(self):
        for name, layout, heads in self.MODELS:
            with self.subTest(model=name):
                args = ["--heads", heads, "--per-head"] + (["--kv-heads", 2] if layout == "llama" else [])
                b = analyze_json(os.path.join(PYTORCH_DATA, name + ".bin"), *args)["checkpoints"][0]
                z = analyze_json(os.path.join(PYTORCH_DATA, name + ".npz"), *args)["checkpoints"][0]
                self.assertEqual(b["source"], "pytorch")
                self.assertEqual(b["layout"], layout)
                self.assertEqual(len(b["layers"]), 2)
                self.assertEqual(b["layers"], z["layers"])
                ref = np.load(os.path.join(PYTORCH_DATA, name + ".npz"))
                if layout == "hf-bert":  # one number against numpy directly
                    W = ref["encoder.layer.1.attention.self.key.weight"].astype(np.float64).T
                    self.close(b["layers"][1]["W_K"]["kappa"], sv(W)[0] / sv(W)[-1], name)

    def test_blocks_in_the_table(self):
        """--blocks shows kappa(J_Q), kappa(J_K), kappa(J_V) in the table, as in JSON."""
        p = os.path.join(PYTORCH_DATA, "mha_zip.bin")
        args = ["analyze", p, "--heads", 2, "--jacobian", "--tokens", 8, "--blocks", "--layers", 0,
                "--quiet"]
        r = run(*args)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        at = [i for i, l in enumerate(lines) if l.startswith("kappa of the Jacobian's blocks")]
        self.assertEqual(len(at), 1, r.stdout)
        rows = [l.split() for l in lines[at[0] + 2:at[0] + 4]]
        doc = json.loads(run(*args, "--format", "json").stdout)
        for row, j in zip(rows, doc["checkpoints"][0]["layers"][0]["jacobian"]):
            self.assertEqual(int(row[1]), j["head"])
            for col, blk in ((3, "J_Q"), (5, "J_K"), (7, "J_V")):
                self.close(float(row[col]), num(j["blocks"][blk]["kappa_plus"]), blk, 1e-3)
        r = run("analyze", p, "--heads", 2, "--jacobian", "--tokens", 8, "--layers", 0, "--quiet")
        self.assertNotIn("blocks", r.stdout)

    def test_correct_keeps_other_tensors(self):
        src = os.path.join(PYTORCH_DATA, "bert_legacy.bin")
        out = self.path("ptc", "out.safetensors")
        r = run("correct", src, "--heads", 2, "--method", "lambda", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        _, tb = read_safetensors_raw(out)
        ref = np.load(os.path.join(PYTORCH_DATA, "bert_legacy.npz"))
        self.assertEqual(sorted(tb), sorted(ref.files))
        for k in ref.files:
            self.assertEqual(tb[k][0], "F32")
            if k.endswith("bias"):
                self.assertEqual(tb[k][2], ref[k].astype("<f4").tobytes(), k)


GGUF_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "gguf")


class TestGguf(Base):
    """A llama GGUF file gguf-py wrote (tests/data/gguf/make_gguf.py): heads from its metadata,
    every kappa (whole and per head) against numpy on the weights before the converter's row
    permutation. The permutation stays inside each head, so kappa cannot see it; test_gguf.cpp
    checks that the rows come back in Hugging Face order."""

    def test_llama_against_numpy(self):
        doc = analyze_json(os.path.join(GGUF_DATA, "llama.gguf"), "--per-head")
        rep = doc["checkpoints"][0]
        self.assertEqual(rep["source"], "gguf")
        self.assertEqual(rep["layout"], "gguf")
        wq = np.load(os.path.join(GGUF_DATA, "llama.attn_q.orig.npy")).T
        wk = np.load(os.path.join(GGUF_DATA, "llama.attn_k.orig.npy")).T
        L = rep["layers"][0]
        self.close(L["W_Q"]["kappa"], sv(wq)[0] / sv(wq)[-1], "gguf W_Q")
        self.close(L["W_K"]["kappa"], sv(wk)[0] / sv(wk)[-1], "gguf W_K")
        self.assertEqual((L["heads"], L["kv_heads"], L["d_k"]), (4, 2, 4))
        self.assertEqual(len(L["per_head"]), 4)
        for j, h in enumerate(L["per_head"]):
            s = sv(wq[:, 4 * j:4 * j + 4])
            self.close(h["W_Q"]["kappa"], s[0] / s[-1], f"gguf head {j} W_Q")
            if "W_K" in h:
                g = j // 2
                s = sv(wk[:, 4 * g:4 * g + 4])
                self.close(h["W_K"]["kappa"], s[0] / s[-1], f"gguf head {j} W_K")

    def test_correct_refuses_gguf(self):
        r = run("correct", os.path.join(GGUF_DATA, "llama.gguf"), "--method", "lambda", "--out",
                self.path("g", "out.safetensors"), "--quiet")
        self.assertEqual(r.returncode, 2)
        self.assertIn("does not rewrite GGUF", r.stderr)


class TestLayoutExtras(Base):
    """--map, T5's unscaled logits and cross-attention, ALBERT's shared layer, GQA kv heads from
    W_K's width."""

    def test_map_gives_the_builtin_numbers(self):
        rng = np.random.default_rng(SEED + 40)
        t, proj = make_model("hf-bert", rng, heads=2)
        renamed = {k.replace("encoder.layer.", "enc.").replace(".attention.self.", ".")
                    .replace("query.weight", "wq").replace("key.weight", "wk")
                    .replace("value.weight", "wv"): v for k, v in t.items()}
        p = self.path("map", "model.safetensors")
        save_file(renamed, p)
        m = r"q=enc\.(\d{1,3})\.wq,k=enc\.(\d{1,3})\.wk,v=enc\.(\d{1,3})\.wv"
        rep = analyze_json(p, "--heads", 2, "--map", m, "--per-head")["checkpoints"][0]
        self.assertEqual(rep["layout"], "map")
        self.assertEqual([L["index"] for L in rep["layers"]], [0, 1])
        self.check_report(rep, proj, 2, 2)
        # A fused Conv1D tensor (GPT-2 storage) under any name.
        t2, proj2 = make_model("gpt2", rng, heads=4)
        p2 = self.path("map2", "model.safetensors")
        save_file({k.replace("h.", "tr.").replace(".attn.c_attn.weight", ".qkv"): v
                   for k, v in t2.items()}, p2)
        rep2 = analyze_json(p2, "--heads", 4, "--map", r"qkv=tr\.(\d+)\.qkv,storage=conv1d",
                            "--per-head")["checkpoints"][0]
        self.check_report(rep2, proj2, 4, 4)
        # correct with --map writes the same slots the analysis read.
        out = self.path("map", "fixed.safetensors")
        r = run("correct", p, "--map", m, "--method", "lambda", "--out", out, "--quiet")
        self.assertEqual(r.returncode, 0, r.stderr)
        from safetensors.numpy import load_file
        f = load_file(out)
        np.testing.assert_array_equal(f["enc.1.wk"], renamed["enc.1.wk"] + 10 * np.eye(16))
        np.testing.assert_array_equal(f["layers_extra.1.mlp.fc1.weight"],
                                      renamed["layers_extra.1.mlp.fc1.weight"])

    def test_t5_scale_one_and_cross_attention(self):
        rng = np.random.default_rng(SEED + 41)
        D = 8
        t = {}
        for stack, kinds in (("encoder", ("0.SelfAttention",)),
                             ("decoder", ("0.SelfAttention", "1.EncDecAttention"))):
            for kind in kinds:
                for n in "qkvo":
                    t[f"{stack}.block.0.layer.{kind}.{n}.weight"] = rng.standard_normal((D, D)) * 0.3
        p = self.path("t5", "model.safetensors")
        save_file(t, p)
        args = ["--heads", 2, "--jacobian", "--tokens", 6, "--no-jacobian-corrections"]
        rep = analyze_json(p, *args)["checkpoints"][0]
        self.assertEqual(rep["layout"], "t5")
        self.assertEqual(num(rep["scale"]), 1.0)
        L = rep["layers"]
        self.assertEqual([x["prefix"] for x in L],
                         ["encoder.block.0.layer.0.SelfAttention.",
                          "decoder.block.0.layer.0.SelfAttention.",
                          "decoder.block.0.layer.1.EncDecAttention."])
        self.assertEqual([x["attention"] for x in L], ["self", "self", "cross"])
        self.assertNotIn("jacobian", L[2])
        self.assertIn("cross-attention: kappa(J) not computed", L[2]["note"])
        self.assertIn("not divided by sqrt(d_k)", L[0]["note"])
        # The encoder layer's kappa(J) is that of scale 1, as --map with --scale 1 computes it.
        enc = {k: v for k, v in t.items() if k.startswith("encoder.")}
        p2 = self.path("t5", "enc_only.safetensors")
        save_file(enc, p2)
        m = r"q=(encoder)\.block\.0.*\.q\.weight,k=(encoder)\.block\.0.*\.k\.weight,v=(encoder)\.block\.0.*\.v\.weight"
        for scale, same in (("1", True), ("0.5", False)):
            # --map says nothing of positions: --rope none (T5 has relative position biases).
            ref = analyze_json(p2, *args, "--map", m, "--scale", scale,
                               "--rope", "none")["checkpoints"][0]
            for h in range(2):
                a = L[0]["jacobian"][h]["J"]["kappa"]
                b = ref["layers"][0]["jacobian"][h]["J"]["kappa"]
                self.assertEqual(a == b, same, (scale, h, a, b))
        table = run("analyze", p, *args, "--quiet")
        self.assertEqual(table.returncode, 0, table.stderr)
        self.assertIn("layer 2 (decoder.block.0.layer.1.EncDecAttention.): cross-attention", table.stdout)

    def test_gqa_kv_heads_from_w_k(self):
        rng = np.random.default_rng(SEED + 42)
        t, proj = make_model("llama", rng, heads=4, kv_heads=2)
        p = self.path("gqa", "model.safetensors")
        save_file(t, p)
        rep = analyze_json(p, "--heads", 4, "--per-head")["checkpoints"][0]  # no --kv-heads
        self.check_report(rep, proj, 4, 2)


class TestBadFiles(Base):
    def test_corpus(self):
        cases = make_bad_files.make_corpus(self.path("bad", "x")[:-2])
        self.assertGreaterEqual(len(cases), 25)
        for c in cases:
            with self.subTest(what=c["what"]):
                try:
                    r = run("analyze", c["path"], *c["args"], "--quiet", timeout=30)
                except subprocess.TimeoutExpired:
                    self.fail(f"{c['what']}: analyze hung")
                self.assertEqual(r.returncode, 2, f"{c['what']}: rc {r.returncode}: {r.stderr}")
                lines = r.stderr.splitlines()
                self.assertEqual(len(lines), 1, f"{c['what']}: {r.stderr!r}")
                names = c["names"] if isinstance(c["names"], list) else [c["names"]]
                for n in names:
                    self.assertIn(n, lines[0], c["what"])
                self.assertEqual(r.stdout, "", c["what"])


def main():
    global EXE
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    args, rest = ap.parse_known_args()
    EXE = os.path.abspath(args.exe)
    unittest.main(argv=[sys.argv[0], *rest], verbosity=2)


if __name__ == "__main__":
    main()
