"""analyze_model on a whole timm ViT-Tiny at 224 x 224 (12 layers x 3 heads, N = 197, D = 192,
d = 64; random initialisation, one random image): the time of the whole analysis with method
auto (goal: 36 heads in at most 5 minutes on the 2-core reference machine), the method auto
chose for each head and why, and, for `--compare K` heads, the time each accurate method takes
on the same head, so that the plan's ranking (conditioning/methods/plan.hpp) can be read against
measured times. Every answer is also checked against lobpcg's on the compared heads.

    .venv-py/bin/python bench/python/bench_vit_tiny.py [--compare 1] [--layers 0,5]

The package pins its OpenBLAS to one thread (SPECTRAL_COND_BLAS_THREADS); torch runs with one.
"""

import argparse
import collections
import time

import torch

import spectral_cond as sc
import spectral_cond.torch as sct


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", type=int, default=1, help="heads to time by every method")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all 12)")
    a = ap.parse_args()
    import timm

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    x = torch.randn(1, 3, 224, 224)
    layers = [int(i) for i in a.layers.split(",")] if a.layers else None
    t0 = time.perf_counter()
    res = sct.analyze_model(model, x, layers=layers)
    total = time.perf_counter() - t0
    print(f"analyze_model, method auto: {len(res)} heads in {total:.1f} s "
          f"({total / max(len(res), 1):.2f} s per head; goal 36 heads in 300 s)")
    print(f"  methods: {dict(collections.Counter(r.method for r in res))}, "
          f"infos: {dict(collections.Counter(r.info for r in res))}")
    print(f"  largest stated accuracy {max(r.accuracy for r in res):.2e}, "
          f"largest check difference {max(r.verify_error for r in res):.2e}")
    print(f"  auto's reason (head 0): {res[0].jacobian.note.split(';')[0]}")
    print(res.summary())
    if a.compare <= 0:
        return
    from spectral_cond import _torch_capture as cap
    sites = sct.find_attention(model)
    calls = cap.capture(model, sites, {0}, x)
    s = sites[0]
    heads, _ = cap.call_model(s, calls[0][0], 0, s.q.W(), s.k.W(), s.v.W())
    for hm in heads[:a.compare]:
        ref = None
        for method in ("matfree", "lobpcg", "qr"):
            t = time.perf_counter()
            r = sc.kappa_jacobian(hm.X, hm.wq, hm.wk, hm.wv, method=method, scale=hm.scale,
                                  biases=hm.biases)
            dt = time.perf_counter() - t
            ref = ref or r
            print(f"  head {hm.head}, {method:8s} {dt:7.1f} s  kappa {r.kappa:.10g}  "
                  f"stated accuracy {r.accuracy:.1e}  rel. to the first "
                  f"{abs(r.kappa - ref.kappa) / ref.kappa:.1e}")


if __name__ == "__main__":
    main()
