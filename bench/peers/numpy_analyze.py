#!/usr/bin/env python3
"""numpy peer of `spectral-cond analyze` (weights only), and the benchmark that compares them.

The same set of SVDs as `analyze` without --per-head (docs/checkpoints.md), for every attention
layer of a timm-layout checkpoint and each of W_Q, W_K, W_V (MATH.md §6–8):
    thin SVD of W                          sigma_max, sigma_min, kappa; U, V for the exact correction
    singular values of W + sigma_1 U V^T   kappa after the exact correction (Theorem 3.5)
    singular values of W + lambda I(D, D)  kappa after lambda I_k, fused placement (Theorem 3.8)
    singular values of W + lambda [I(D, d) | ...]   per-head placement (skipped for one head)

Modes:
    numpy_analyze.py write-vitb PATH [--dtype F32]     a ViT-B-shaped checkpoint (12 x 768, 12 heads)
    numpy_analyze.py analyze PATH --heads H            the numpy analysis, JSON on stdout
    numpy_analyze.py bench --exe spectral-cond [--exe-lapack other-build/spectral-cond]
        writes the ViT-B checkpoint, times both (best of --repeat), checks that every kappa
        agrees, prints the time ratio spectral-cond / numpy (goal: <= 1).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_vitb(path, layers=12, D=768, seed=0, dtype=np.float32):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(layers):
        t[f"blocks.{i}.attn.qkv.weight"] = (rng.standard_normal((3 * D, D)) * 0.02).astype(dtype)
        t[f"blocks.{i}.attn.qkv.bias"] = np.zeros(3 * D, dtype=dtype)
        t[f"blocks.{i}.mlp.fc1.weight"] = (rng.standard_normal((4 * D, D)) * 0.02).astype(dtype)
    save_file(t, path, metadata={"format": "pt"})
    with open(os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"), "w") as f:
        json.dump({"num_attention_heads": 12, "hidden_size": D}, f)


def kappa(s):
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")


def analyze(path, heads, lam=10.0):
    from safetensors import safe_open
    out = []
    with safe_open(path, framework="numpy") as f:
        names = sorted((n for n in f.keys() if n.endswith("attn.qkv.weight")),
                       key=lambda n: int(n.split(".")[1]))
        for n in names:
            T = f.get_tensor(n).astype(np.float64)
            D = T.shape[1]
            d = D // heads
            layer = {"index": int(n.split(".")[1])}
            for j, role in enumerate(("W_Q", "W_K", "W_V")):
                W = T[j * D:(j + 1) * D].T
                U, S, Vt = np.linalg.svd(W, full_matrices=False)
                ex = np.linalg.svd(W + S[0] * (U @ Vt), compute_uv=False)
                fu = np.linalg.svd(W + lam * np.eye(D, W.shape[1]), compute_uv=False)
                ph = fu if heads == 1 else np.linalg.svd(
                    W + lam * np.hstack([np.eye(D, d)] * heads), compute_uv=False)
                layer[role] = {"sigma_max": float(S[0]), "sigma_min": float(S[-1]),
                               "kappa": kappa(S), "exact": kappa(ex), "fused": kappa(fu),
                               "per_head": kappa(ph)}
            out.append(layer)
    return out


def best_time(cmd, repeat, env=None):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed: {r.stderr}")
        best, out = min(best, dt), r.stdout
    return best, out


def max_rel_diff(tool_doc, peer):
    worst = 0.0
    for L, P in zip(tool_doc["checkpoints"][0]["layers"], peer):
        for role in ("W_Q", "W_K", "W_V"):
            m = L[role]
            pairs = [(m["sigma_max"], P[role]["sigma_max"]), (m["sigma_min"], P[role]["sigma_min"]),
                     (m["kappa"], P[role]["kappa"]), (m["exact"]["kappa"], P[role]["exact"]),
                     (m["lambda_fused"]["kappa"], P[role]["fused"]),
                     (m["lambda_per_head"]["kappa"], P[role]["per_head"])]
            for a, b in pairs:
                worst = max(worst, abs(float(a) - b) / abs(b))
    return worst


def bench(args):
    with tempfile.TemporaryDirectory(prefix="sc_bench_analyze_") as d:
        path = os.path.join(d, "model.safetensors")
        write_vitb(path, layers=args.layers)
        print(f"ViT-B-shaped checkpoint: {args.layers} layers, D = 768, 12 heads, timm, float32")
        peer_cmd = [sys.executable, os.path.abspath(__file__), "analyze", path, "--heads", "12"]
        t_np, peer_out = best_time(peer_cmd, args.repeat)
        peer = json.loads(peer_out)
        print(f"  numpy (OpenBLAS {np.__version__}):        {t_np:8.2f} s  (best of {args.repeat})")
        env1 = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        t_np1, _ = best_time(peer_cmd, args.repeat, env1)
        print(f"  numpy, one thread:                 {t_np1:8.2f} s")
        for label, exe in (("spectral-cond", args.exe), ("spectral-cond (LAPACK)", args.exe_lapack)):
            if not exe:
                continue
            cmd = [exe, "analyze", path, "--format", "json", "--quiet"]
            t, out = best_time(cmd, args.repeat)
            err = max_rel_diff(json.loads(out), peer)
            print(f"  {label:<33s}{t:8.2f} s  ratio to numpy {t / t_np:5.2f} "
                  f"(to one-thread numpy {t / t_np1:5.2f}); max rel. diff of every sigma/kappa "
                  f"{err:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write-vitb")
    w.add_argument("path")
    w.add_argument("--layers", type=int, default=12)
    a = sub.add_parser("analyze")
    a.add_argument("path")
    a.add_argument("--heads", type=int, required=True)
    a.add_argument("--lambda", dest="lam", type=float, default=10.0)
    b = sub.add_parser("bench")
    b.add_argument("--exe", required=True)
    b.add_argument("--exe-lapack")
    b.add_argument("--layers", type=int, default=12)
    b.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    if args.mode == "write-vitb":
        write_vitb(args.path, layers=args.layers)
    elif args.mode == "analyze":
        print(json.dumps(analyze(args.path, args.heads, args.lam)))
    else:
        bench(args)


if __name__ == "__main__":
    main()
