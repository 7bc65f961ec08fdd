#!/usr/bin/env python3
"""Saturation of attention under every reading of lambda I, at real shapes, without training
(docs/reproduction.md, "Saturation at real shapes"; MATH.md §7 and §17).

A ViT-B-shaped stack (timm: D = 768, 12 layers of 12 heads, d = 64, N = 197 with the class token)
and a GPT-2-small-shaped one (transformers: D = 768, 12 x 12 heads, N = 1024, causal), both at
their libraries' random initialisation, read real data that ships offline: scikit-learn's two
bundled sample photographs cut into 224 x 224 crops, and the bytes of the licence texts every
Debian system has (/usr/share/common-licenses) as token ids. For every lambda of the grid and
every placement of lambda I (spectral_cond.torch.spectral_conditioning applied to the whole model,
so that each layer reads the activations the corrected model gives it), per layer and head:

- the attention pattern P, computed here in float64 from the layer's captured input and its
  effective weights (W + C, biases) and checked against the module's own output (P V must equal
  what the module passes to its output projection);
- the fraction of saturated rows (max_j P_ij > 1 - 1e-6), the class token's attention to itself
  (ViT), the mean row entropy;
- the logit scale lambda^2 c d var(x) of the identity (x the layer's tokens, c = 1/sqrt(d)): the
  self-logit it adds (MATH.md §17), the law the plot tests;
- ||J_QK||/||J_V|| of sampled heads of the first, middle and last layers
  (spectral_cond.attention_diagnostics);
- the float32 gradient norms of W_Q and W_K (a loss of the model's own kind: cross-entropy on
  fixed labels for the ViT, next-byte prediction for GPT-2);
- kappa(J) of sampled heads by the accurate method (`--kappa`, ViT-B only by default: J of a
  GPT-2 head at N = 1024 has 65,536 x 786,432 entries);
- the Weyl threshold s (kappa + 1)/(kappa - 1) of each head's W_Q slice (s = sigma_1): the
  lambda from which lambda I provably lowers kappa(W_Q) (MATH.md §7).

  .venv-py/bin/python experiments/saturation.py            both shapes (minutes on 2 cores)
  .venv-py/bin/python experiments/saturation.py --quick    tiny shapes: checks the pipeline

Writes --out/saturation.json (every row and the configuration), saturation.csv (one row per
shape, placement, lambda and layer) and saturation.png (saturated fraction against the logit
scale, every shape and placement).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from typing import Dict, List

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
PLACEMENTS = ("fused", "per_head", "packed", "fused:qk", "fused:q", "fused:v")
SATURATED = 1 - 1e-6
CORPUS_DIR = "/usr/share/common-licenses"


# ---- the two shapes and their data ---------------------------------------------------------

def vit(quick: bool):
    import timm

    cfg = dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12)
    if quick:
        cfg = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(num_classes=10, **cfg)
    return model, cfg


def sample_crops(side: int, count: int) -> torch.Tensor:
    """`count` side x side crops of scikit-learn's two sample photographs (china.jpg,
    flower.jpg), normalised with ImageNet's mean and deviation, as timm's models expect."""
    from sklearn.datasets import load_sample_images

    imgs = load_sample_images().images
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        im = imgs[i % len(imgs)]
        y = rng.integers(0, im.shape[0] - side + 1)
        x = rng.integers(0, im.shape[1] - side + 1)
        out.append(im[y:y + side, x:x + side].astype(np.float32) / 255.0)
    a = np.stack(out).transpose(0, 3, 1, 2)
    mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)[None, :, None, None]
    std = np.array([0.229, 0.224, 0.225], dtype=np.float32)[None, :, None, None]
    return torch.from_numpy((a - mean) / std)


def gpt2(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = dict(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    if quick:
        cfg = dict(n_positions=48, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    conf = GPT2Config(vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg)
    conf._attn_implementation = "eager"
    return GPT2LMHeadModel(conf), cfg


def corpus_window(length: int) -> torch.Tensor:
    """The first `length` bytes of the Debian licence texts (files in name order, links
    skipped), as token ids (a byte is a valid GPT-2 id; the weights are random anyway)."""
    data = b""
    for name in sorted(os.listdir(CORPUS_DIR)):
        p = os.path.join(CORPUS_DIR, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                data += f.read()
        if len(data) >= length:
            break
    if len(data) < length:
        raise RuntimeError(f"saturation: {CORPUS_DIR} holds fewer than {length} bytes")
    return torch.tensor(list(data[:length]), dtype=torch.int64)[None, :]


# ---- measuring one corrected model ---------------------------------------------------------

class Capture:
    """Forward hooks: each attention module's input tokens, and what it passes to its output
    projection (the heads' P V side by side)."""

    def __init__(self, sites):
        self.x: Dict[int, torch.Tensor] = {}
        self.o: Dict[int, torch.Tensor] = {}
        self.handles = []
        for i, s in enumerate(sites):
            proj = getattr(s.module, "proj", None) or getattr(s.module, "c_proj")
            self.handles.append(s.module.register_forward_pre_hook(self._take(self.x, i),
                                                                   with_kwargs=True))
            self.handles.append(proj.register_forward_pre_hook(self._take(self.o, i),
                                                               with_kwargs=True))

    @staticmethod
    def _take(store, i):
        def hook(module, args, kwargs):
            t = args[0] if args else next(iter(kwargs.values()))
            store[i] = t.detach().to(torch.float64)
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def site_weights(site):
    """The site's effective (W + C) W_Q, W_K, W_V (D x heads d) and biases, float64: read once
    per site, sliced per head by head_weights."""
    return [(p.W(), p.b()) for p in (site.q, site.k, site.v)]


def head_weights(site, h: int, full=None):
    """Head h's effective W_Q, W_K, W_V slices (D x d) and biases, from site_weights(site)."""
    d = site.head_dim
    g = h // (site.heads // site.kv_heads)
    out = []
    for (W, b), j in zip(full or site_weights(site), (h, g, g)):
        out.append((W[:, j * d:(j + 1) * d], None if b is None else b[j * d:(j + 1) * d]))
    return out


def pattern(X: np.ndarray, wq, wk, c: float, causal: bool) -> np.ndarray:
    q = X @ wq[0] + (0 if wq[1] is None else wq[1])
    k = X @ wk[0] + (0 if wk[1] is None else wk[1])
    Z = c * q @ k.T
    if causal:
        Z = np.where(np.tril(np.ones(Z.shape, dtype=bool)), Z, -np.inf)
    Z = Z - Z.max(axis=1, keepdims=True)
    P = np.exp(Z)
    return P / P.sum(axis=1, keepdims=True)


def grad_norms(site, param_grads) -> List[float]:
    """||dL/dW_Q||_F and ||dL/dW_K||_F of the site (its rows or columns of the parameter)."""
    out = []
    for p in (site.q, site.k):
        G = param_grads[(id(p.owner), p.param)]
        idx = torch.as_tensor(p.features)
        sel = G.index_select(0 if p.transposed else 1, idx)
        out.append(float(sel.to(torch.float64).norm()))
    return out


def measure(kind: str, model, batch, lam: float, placement: str, args, rng_heads) -> List[dict]:
    import spectral_cond as sc
    import spectral_cond.torch as sct

    if lam > 0:
        sct.spectral_conditioning(model, method="lambda", lam=lam, placement=placement)
    try:
        sites = sct.find_attention(model)
        cap = Capture(sites)
        model.zero_grad(set_to_none=True)
        try:
            if kind == "vit":
                logits = model(batch)
                labels = torch.arange(batch.shape[0]) % logits.shape[1]
                loss = torch.nn.functional.cross_entropy(logits, labels)
            else:
                loss = model(batch, labels=batch).loss
            loss.backward()
        finally:
            cap.close()
        grads = {}
        for s in sites:
            for p in (s.q, s.k):
                key = (id(p.owner), p.param)
                if key in grads:
                    continue
                if torch.nn.utils.parametrize.is_parametrized(p.owner, p.param):
                    t = p.owner.parametrizations[p.param].original
                else:
                    t = getattr(p.owner, p.param)
                grads[key] = t.grad
        rows = []
        causal = kind == "gpt2"
        for li, s in enumerate(sites):
            Xall, Oall = cap.x[li].numpy(), cap.o[li].numpy()
            d = s.head_dim
            c = 1 / math.sqrt(d)
            var_x = float(Xall.var())  # per coordinate, over tokens and images
            sat, cls_self, ent, err, lib_err = [], [], [], 0.0, 0.0
            qk_v, kappas = [], []
            sampled = set(rng_heads[li])
            diag_layers = {0, len(sites) // 2, len(sites) - 1}
            full = site_weights(s)
            for h in range(s.heads):
                wq, wk, wv = head_weights(s, h, full)
                for b in range(Xall.shape[0]):
                    X = Xall[b]
                    P = pattern(X, wq, wk, c, causal)
                    V = X @ wv[0] + (0 if wv[1] is None else wv[1])
                    O = Oall[b][:, h * d:(h + 1) * d]
                    err = max(err, float(np.abs(P @ V - O).max() / max(np.abs(O).max(), 1e-30)))
                    # A causal row 0 has one key: one-hot by construction, not saturation.
                    m = P.max(axis=1)[1:] if causal else P.max(axis=1)
                    sat.append(float(np.mean(m > SATURATED)))
                    if kind == "vit":
                        cls_self.append(float(P[0, 0]))
                    with np.errstate(divide="ignore", invalid="ignore"):
                        ent.append(float(np.mean(-np.sum(np.where(P > 0, P * np.log(P), 0.0),
                                                         axis=1))))
                    if h in sampled and b == 0 and li in diag_layers:
                        mask = "causal" if causal else None
                        biases = None
                        if any(w[1] is not None for w in (wq, wk, wv)):
                            biases = tuple(w[1] for w in (wq, wk, wv))
                        dg = sc.attention_diagnostics(X, wq[0], wk[0], wv[0], scale=c, mask=mask,
                                                      biases=biases)
                        qk_v.append(float(dg.ratio_QK_V))
                        # the library's count of saturated rows against the one made here
                        lib_err = max(lib_err, abs(dg.saturated_fraction - sat[-1]))
                        if args.kappa and kind in args.kappa_shapes and li == 0 and \
                                lam in args.kappa_lambdas and \
                                placement in args.kappa_placements and \
                                h in rng_heads[li][:args.kappa_heads]:
                            t0 = time.perf_counter()
                            r = sc.kappa_jacobian(X, wq[0], wk[0], wv[0], scale=c, mask=mask,
                                                  biases=biases)
                            kappas.append(dict(head=h, kappa=r.kappa, info=r.info,
                                               method=r.method, accuracy=r.accuracy,
                                               seconds=time.perf_counter() - t0))
            gq, gk = grad_norms(s, grads)
            rows.append(dict(
                shape=kind, placement=placement, lam=lam, layer=li, heads=s.heads, d=d,
                tokens=int(Xall.shape[1]), var_x=var_x, logit_scale=lam * lam * c * d * var_x,
                saturated_fraction=float(np.mean(sat)),
                heads_saturated=int(sum(1 for h in range(s.heads)
                                        if np.mean(sat[h * Xall.shape[0]:(h + 1) * Xall.shape[0]])
                                        > 0.5)),
                cls_self_attention=float(np.mean(cls_self)) if cls_self else None,
                entropy=float(np.mean(ent)),
                qk_v_ratio_median=float(np.median(qk_v)) if qk_v else None,
                grad_WQ=gq, grad_WK=gk, pattern_check=err, library_check=lib_err,
                kappa_J=kappas,
                loss=float(loss.detach())))
        return rows
    finally:
        if lam > 0:
            sct.remove(model, fold=False)


def weyl_thresholds(model) -> List[float]:
    """Per layer, the median over heads of s (kappa + 1)/(kappa - 1) of the head's W_Q slice."""
    import spectral_cond.torch as sct

    out = []
    for s in sct.find_attention(model):
        W = s.q.W()
        d = s.head_dim
        t = []
        for h in range(s.heads):
            sv = np.linalg.svd(W[:, h * d:(h + 1) * d], compute_uv=False)
            k = sv[0] / sv[-1]
            t.append(sv[0] * (k + 1) / (k - 1) if k > 1 else math.inf)
        out.append(float(np.median(t)))
    return out


# ---- the run, the files, the plot ----------------------------------------------------------

def run_shape(kind: str, args, log) -> dict:
    model, cfg = vit(args.quick) if kind == "vit" else gpt2(args.quick)
    model.train()  # dropout is zero in both configurations; train() only for the gradients
    if kind == "vit":
        batch = sample_crops(cfg["img_size"], args.images)
    else:
        batch = corpus_window(cfg["n_positions"])
    import spectral_cond.torch as sct

    sites = sct.find_attention(model)
    rng = np.random.default_rng(args.seed)
    heads = [sorted(rng.choice(s.heads, size=min(args.sample_heads, s.heads), replace=False))
             for s in sites]
    rows = []
    t0 = time.perf_counter()
    for placement in args.placements:
        for lam in args.lambdas:
            if lam == 0 and placement != args.placements[0]:
                # lam = 0 is the same model under every placement
                rows.extend(dict(r, placement=placement) for r in rows if r["lam"] == 0 and
                            r["placement"] == args.placements[0])
                continue
            rows.extend(measure(kind, model, batch, lam, placement, args, heads))
            log(f"{kind}: {placement} lambda {lam:g} done after {time.perf_counter() - t0:.0f} s")
    return dict(shape=kind, config=cfg, sampled_heads=[list(map(int, h)) for h in heads],
                weyl_threshold_WQ=weyl_thresholds(model), rows=rows,
                seconds=time.perf_counter() - t0,
                data=("scikit-learn sample images, %d crops" % args.images if kind == "vit"
                      else f"{CORPUS_DIR} bytes, one window of {cfg['n_positions']}"))


def write_csv(path: str, shapes: List[dict]) -> None:
    keys = ["shape", "placement", "lam", "layer", "heads", "d", "tokens", "var_x", "logit_scale",
            "saturated_fraction", "heads_saturated", "cls_self_attention", "entropy",
            "qk_v_ratio_median", "grad_WQ", "grad_WK", "pattern_check", "loss"]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for s in shapes:
            for r in s["rows"]:
                w.writerow(["" if r[k] is None else r[k] for k in keys])
    os.replace(tmp, path)


def plot(path: str, shapes: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        for placement in dict.fromkeys(r["placement"] for r in s["rows"]):
            pts = {}
            for r in s["rows"]:
                if r["placement"] == placement and r["lam"] > 0:
                    pts.setdefault(r["lam"], []).append((r["logit_scale"],
                                                         r["saturated_fraction"]))
            xs = [np.median([p[0] for p in v]) for v in pts.values()]
            ys = [np.median([p[1] for p in v]) for v in pts.values()]
            ax.plot(xs, ys, marker="o", label=placement)
        ax.set_xscale("log")
        ax.set_xlabel("lambda^2 c d var(x)  (median over layers)")
        ax.set_ylabel("saturated rows (median over layers)")
        ax.set_title(f"{s['shape']}: D = {s['rows'][0]['heads'] * s['rows'][0]['d']}, "
                     f"d = {s['rows'][0]['d']}, N = {s['rows'][0]['tokens']}")
        ax.axvline(math.log(s["rows"][0]["tokens"] - 1) + math.log(1e6), color="grey", ls=":",
                   label="ln((N-1)/1e-6)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def summary_lines(shapes: List[dict]) -> List[str]:
    out = []
    for s in shapes:
        out.append(f"{s['shape']} ({s['data']}; {s['seconds']:.0f} s); Weyl threshold of W_Q "
                   f"(median over layers of the heads' median): "
                   f"{np.median(s['weyl_threshold_WQ']):.3g}")
        out.append(f"  {'placement':<10}{'lambda':>7}{'scale':>10}{'saturated':>11}"
                   f"{'cls->cls':>10}{'entropy':>9}{'QK/V':>10}{'|gWQ|':>10}{'|gWK|':>10}")
        for placement in dict.fromkeys(r["placement"] for r in s["rows"]):
            for lam in dict.fromkeys(r["lam"] for r in s["rows"]):
                rs = [r for r in s["rows"] if r["placement"] == placement and r["lam"] == lam]
                def med(k):
                    v = [r[k] for r in rs if r[k] is not None]
                    return float(np.median(v)) if v else float("nan")

                cls = (f"{np.median([r['cls_self_attention'] for r in rs]):10.3f}"
                       if rs[0]["cls_self_attention"] is not None else f"{'-':>10}")
                gq = float(np.median([r["grad_WQ"] for r in rs]))
                gk = float(np.median([r["grad_WK"] for r in rs]))
                out.append(f"  {placement:<10}{lam:>7g}{med('logit_scale'):>10.3g}"
                           f"{med('saturated_fraction'):>11.3f}{cls}{med('entropy'):>9.3f}"
                           f"{med('qk_v_ratio_median'):>10.3g}{gq:>10.3g}{gk:>10.3g}")
        for r in s["rows"]:
            for k in r["kappa_J"]:
                out.append(f"  kappa(J) {s['shape']} layer 0 head {k['head']}, {r['placement']} "
                           f"lambda {r['lam']:g}: {k['kappa']:.4g} ({k['info']}, {k['method']}, "
                           f"accuracy {k['accuracy']:.2g}, {k['seconds']:.1f} s)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the pipeline")
    ap.add_argument("--shapes", default="vit,gpt2", help="comma-separated: vit,gpt2")
    ap.add_argument("--lambdas", default=",".join(f"{x:g}" for x in LAMBDAS))
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--images", type=int, default=4, help="crops for the ViT (default 4)")
    ap.add_argument("--sample-heads", type=int, default=2,
                    help="heads per layer for ||J_QK||/||J_V|| (default 2)")
    ap.add_argument("--kappa", action="store_true",
                    help="also kappa(J) of --kappa-heads sampled heads of layer 0 at "
                         "--kappa-lambdas and --kappa-placements (a ViT-B head: about 75 s each)")
    ap.add_argument("--kappa-lambdas", default="0,1,10")
    ap.add_argument("--kappa-shapes", default="vit")
    ap.add_argument("--kappa-placements", default="fused,per_head,packed")
    ap.add_argument("--kappa-heads", type=int, default=1,
                    help="of the sampled heads of layer 0, how many get kappa(J) (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the head sample")
    ap.add_argument("--out", default=None,
                    help="output folder (default experiments/out-saturation[-quick])")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    args.lambdas = [float(x) for x in args.lambdas.split(",")]
    if not args.lambdas or any(not (math.isfinite(x) and x >= 0) for x in args.lambdas):
        ap.error("--lambdas: finite numbers >= 0")
    args.placements = args.placements.split(",")
    args.kappa_lambdas = [float(x) for x in args.kappa_lambdas.split(",")]
    args.kappa_shapes = args.kappa_shapes.split(",")
    args.kappa_placements = args.kappa_placements.split(",")
    shapes = args.shapes.split(",")
    if any(s not in ("vit", "gpt2") for s in shapes):
        ap.error("--shapes: vit and/or gpt2")
    out = args.out or os.path.join(HERE, "out-saturation" + ("-quick" if args.quick else ""))
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(args.threads if args.threads > 0 else max(1, os.cpu_count() or 1))
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    results = [run_shape(k, args, log) for k in shapes]
    doc = dict(config=dict(lambdas=args.lambdas, placements=args.placements, quick=args.quick,
                           images=args.images, sample_heads=args.sample_heads, seed=args.seed,
                           saturated="max_j P_ij > 1 - 1e-6", torch=torch.__version__,
                           python=platform.python_version(), machine=platform.machine()),
               shapes=results, seconds=time.perf_counter() - t0)
    tmp = os.path.join(out, "saturation.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=float)
    os.replace(tmp, os.path.join(out, "saturation.json"))
    write_csv(os.path.join(out, "saturation.csv"), results)
    plot(os.path.join(out, "saturation.png"), results)
    lines = summary_lines(results)
    with open(os.path.join(out, "saturation.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}/saturation.json, .csv, .txt, .png in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
