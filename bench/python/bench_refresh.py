"""The cost of recomputing the exact correction during training (spectral_conditioning(...,
method="exact", refresh_every=k), the paper's variant of Theorem 3.5's C) against a fixed C, the
fixed lambda I and no conditioning: the time of one training step (forward, backward, AdamW) of a
timm ViT, as ratios to the unconditioned step measured in the same run, arms interleaved step by
step so that the machine's drift reaches every arm alike.

    .venv-py/bin/python bench/python/bench_refresh.py [--steps 30] [--depth 6] [--dim 192]

One torch thread and one OpenBLAS thread for the package (SPECTRAL_COND_BLAS_THREADS), so that
the ratios do not depend on what else the machine runs. The paper reports 41:38 against 29:33
(1.40) for its exact variant against lambda I on ViT-B with GPUs; a refresh costs one SVD per
head block of W_Q, W_K, W_V (D x d each), the same work at any batch size, so its share falls as
the batch grows.
"""

import argparse
import statistics
import time

import torch


def make_model(dim: int, depth: int, heads: int):
    import timm

    return timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=4, embed_dim=dim, depth=depth, num_heads=heads, num_classes=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per arm")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import spectral_cond.torch as sct

    arms = {
        "none": {},
        "lambda fixed": dict(method="lambda", lam=1.0, placement="per_head"),
        "exact fixed": dict(method="exact", placement="per_head"),
        "exact refresh_every=10": dict(method="exact", placement="per_head", refresh_every=10),
        "exact refresh_every=1": dict(method="exact", placement="per_head", refresh_every=1),
    }
    models, opts = {}, {}
    for name, kw in arms.items():
        torch.manual_seed(0)
        m = make_model(a.dim, a.depth, a.heads).train()
        if kw:
            sct.spectral_conditioning(m, **kw)
        models[name] = m
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(a.batch, 3, 32, 32)
    y = torch.randint(0, 10, (a.batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    times = {name: [] for name in arms}
    for step in range(a.steps + 2):  # two warm-up steps
        for name in arms:
            t0 = time.perf_counter()
            opts[name].zero_grad()
            loss_fn(models[name](x), y).backward()
            opts[name].step()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    print(f"timm ViT: D = {a.dim}, depth {a.depth}, {a.heads} heads, N = 65, batch {a.batch}; "
          f"{a.steps} steps per arm, 1 torch thread; median step of 'none' {base * 1e3:.1f} ms")
    mbase = statistics.mean(times["none"])
    print(f"{'arm':<26}{'median step / none':>20}{'mean step / none':>18}"
          f"{'mean over none (ms)':>21}")
    for name in arms:
        med, mean = statistics.median(times[name]), statistics.mean(times[name])
        print(f"{name:<26}{med / base:>20.3f}{mean / mbase:>18.3f}{(mean - mbase) * 1e3:>21.2f}")
    ef, e1 = statistics.median(times["exact fixed"]), statistics.median(times["exact refresh_every=1"])
    print(f"refresh_every=1 against exact fixed: {e1 / ef:.3f}")


if __name__ == "__main__":
    main()
