"""Two ratios of the Python package on PyTorch models, measured in one run:

1. analyze_model(model, x, jacobian=False) on a 12-layer ViT-Tiny-sized encoder (D = 192, 3 heads,
   N = 197 tokens) against WeightWatcher-style numpy: np.linalg.svd of the same per-head W_Q, W_K,
   W_V blocks (108 blocks of 192 x 64), with the kappa values checked equal to 1e-10;
2. KappaMonitor's overhead on training: the same seeded training loop with and without a monitor
   (every `--every` steps, one sampled head per layer, kappa(J) by method auto), as a fraction
   of the unmonitored time, and the monitor's own overhead_s.

    OPENBLAS_NUM_THREADS=1 .venv-py/bin/python bench/python/bench_models.py [--repeats 3]

Both sides run in this process with the same BLAS thread count (say which in the output);
torch runs with one thread.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn

import spectral_cond.torch as sct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_binding import best_of  # noqa: E402  (one timing helper for the Python benchmarks)


def vit_tiny(layers=12, D=192, heads=3):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, heads, dim_feedforward=4 * D, batch_first=True,
                                       norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).double().eval()


def numpy_kappas(model, heads):
    """kappa of every head's W_Q, W_K, W_V block by np.linalg.svd (singular values only)."""
    out = []
    for mod in model.layers:
        W = mod.self_attn.in_proj_weight.detach().numpy()
        D = W.shape[1]
        d = D // heads
        for h in range(heads):
            for j in range(3):
                B = W[j * D + h * d: j * D + (h + 1) * d].T
                s = np.linalg.svd(B, compute_uv=False)
                out.append(s[0] / s[-1])
    return out


def bench_analyze(repeats):
    model = vit_tiny()
    x = torch.randn(1, 197, 192, dtype=torch.float64)
    rows = sct.analyze_model(model, x, jacobian=False)
    ours = [k for r in rows for k in (r.kappa_WQ, r.kappa_WK, r.kappa_WV)]
    ref = numpy_kappas(model, 3)
    err = max(abs(a - b) / b for a, b in zip(ours, ref))
    t_sc = best_of(lambda: sct.analyze_model(model, x, jacobian=False), repeats)
    t_np = best_of(lambda: numpy_kappas(model, 3), repeats)
    print(f"analyze_model(jacobian=False), 12 layers x 3 heads, D = 192, N = 197: "
          f"{t_sc:.4f} s (finding the modules and building the rows included; the model is not "
          f"run without kappa(J)); numpy SVDs of the same "
          f"108 blocks: {t_np:.4f} s; ratio {t_sc / t_np:.3f} (goal <= 1); max relative "
          f"difference of kappa {err:.1e}")


def train(monitor_every, steps, log):
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True,
                                       norm_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 32, 64, generator=g)
    y = torch.randn(8, 32, 64, generator=g)
    mon = sct.KappaMonitor(model, every=monitor_every, log=log, heads=1) if monitor_every else None
    t0 = time.perf_counter()
    for step in range(steps):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mon is not None:
            mon(step, x, loss=loss.item())
    t = time.perf_counter() - t0
    if mon is not None:
        mon.close()
    return t, (mon.overhead_s if mon else 0.0)


def bench_monitor(steps, every, tmp):
    base, _ = train(0, steps, None)
    monitored, over = train(every, steps, os.path.join(tmp, "kappa.jsonl"))
    print(f"KappaMonitor (every {every} steps, 1 head per layer, 4 layers, D = 64, batch 8 x 32 "
          f"tokens, {steps} Adam steps): training {base:.2f} s without, {monitored:.2f} s with; "
          f"overhead {(monitored - base) / base:.1%} of training (overhead_s {over:.2f} s, "
          f"{over / max(1, (steps + every - 1) // every):.3f} s per measured step)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
          f"torch threads {torch.get_num_threads()}, best of {a.repeats}")
    bench_analyze(a.repeats)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        bench_monitor(a.steps, a.every, tmp)


if __name__ == "__main__":
    main()
