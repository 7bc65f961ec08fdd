"""One training run of the experiment: a task, an arm and a seed (docs/reproduction.md).

The seed fixes the initialisation (torch.manual_seed before the model is built, so every arm of
a seed starts from the same W) and the data order (a generator of its own); the arm then adds
its fixed correction (spectral_cond.torch.spectral_conditioning) to W_Q, W_K, W_V. At epoch 0
(initialisation) and after every epoch the run evaluates the model and measures, through
spectral_cond.torch.KappaMonitor at a fixed probe sequence, every head of every layer: kappa of
the effective W_Q, W_K, W_V blocks, kappa(J) with its method and stated accuracy, the bound
without hypothesis (MATH.md §5) and the attention diagnostics (MATH.md §11).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.nn import functional as F

import spectral_cond.torch as sct

from data import (SHAPES, corpus, corpus_validation, digits, shapes, validation_split,
                  windows)
from models import Attention, CharLM, ViT

# The arms of the first round: (method, lambda, placement) for spectral_conditioning, None for
# the baseline.
ARMS: Dict[str, Optional[Tuple[str, float, str]]] = {
    "baseline": None,
    "lambda10_fused": ("lambda", 10.0, "fused"),
    "lambda10_per_head": ("lambda", 10.0, "per-head"),
    "lambda1_fused": ("lambda", 1.0, "fused"),
    "exact_fused": ("exact", 0.0, "fused"),
}


@dataclass(frozen=True)
class Arm:
    """One arm of the second round (experiments/round2.py): the correction spectral_conditioning
    adds (method None: none), the exact correction recomputed every `refresh_every` steps, the
    advisor's choice at initialisation (`advised`), or the escape arm (`escape`: lambda I with
    twice the epochs at learning rate ESCAPE_LR, a movement budget lr x steps above lambda)."""

    method: Optional[str] = None
    lam: float = 0.0
    placement: str = "fused"
    refresh_every: Optional[int] = None
    advised: bool = False
    escape: bool = False


ESCAPE_LR = 1e-2

ARMS2: Dict[str, Arm] = {
    "baseline": Arm(),
    **{f"lambda{x:g}_fused": Arm("lambda", x) for x in (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)},
    "lambda10_per_head": Arm("lambda", 10.0, "per_head"),
    "lambda10_packed": Arm("lambda", 10.0, "packed"),  # I on the Q block alone
    "lambda10_v": Arm("lambda", 10.0, "fused:v"),
    "lambda10_qk": Arm("lambda", 10.0, "fused:qk"),
    "exact_fused": Arm("exact"),
    "exact_refresh": Arm("exact", refresh_every=1),
    "advised": Arm(advised=True),
    "escape_lambda10": Arm("lambda", 10.0, escape=True),
}

# The advisor arm's grid (spectral_cond.torch.advise at initialisation, every head).
ADVISE_LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
ADVISE_PLACEMENTS = ("fused", "per_head", "packed", "fused:v", "fused:qk")


def arm_spec(arm: str) -> Arm:
    """The arm of either round by name."""
    if arm in ARMS2:
        return ARMS2[arm]
    if arm in ARMS:
        v = ARMS[arm]
        return Arm() if v is None else Arm(v[0], v[1], v[2])
    raise ValueError(f"arm must be one of {', '.join(dict.fromkeys([*ARMS, *ARMS2]))} "
                     f"(got {arm!r})")


@dataclass
class TaskConfig:
    """Sizes and hyperparameters of one task: the same for every arm (chosen on the baseline,
    docs/reproduction.md)."""

    task: str
    D: int
    depth: int
    heads: int
    mlp: int
    epochs: int
    batch: int
    lr: float
    weight_decay: float = 0.05
    context: int = 0  # language: the sequence length
    steps_per_epoch: int = 0  # language: batches per epoch (0: one pass over the data)
    valid_windows: int = 0  # language: held-out windows evaluated


def task_config(task: str, quick: bool = False, lr: Optional[float] = None) -> TaskConfig:
    if task == "shapes":
        c = (TaskConfig("shapes", D=24, depth=1, heads=2, mlp=32, epochs=1, batch=64, lr=1e-3)
             if quick else
             TaskConfig("shapes", D=32, depth=3, heads=4, mlp=64, epochs=25, batch=64, lr=1e-3))
    elif task == "vision":
        c = (TaskConfig("vision", D=24, depth=1, heads=2, mlp=32, epochs=1, batch=64, lr=1e-3)
             if quick else
             TaskConfig("vision", D=32, depth=3, heads=4, mlp=64, epochs=30, batch=64, lr=3e-4))
    elif task == "language":
        c = (TaskConfig("language", D=16, depth=1, heads=2, mlp=32, epochs=1, batch=16,
                        lr=1e-3, context=12, steps_per_epoch=10, valid_windows=32)
             if quick else
             TaskConfig("language", D=48, depth=2, heads=4, mlp=96, epochs=12, batch=32,
                        lr=3e-3, context=32, steps_per_epoch=150, valid_windows=512))
    else:
        raise ValueError(f"task must be 'vision', 'shapes' or 'language' (got {task!r})")
    if lr is not None:
        c.lr = lr
    return c


def is_image(task: str) -> bool:
    return task in ("vision", "shapes")


def _build(c: TaskConfig, vocab: int = 0) -> torch.nn.Module:
    if c.task == "vision":
        return ViT(c.D, c.depth, c.heads, c.mlp)
    if c.task == "shapes":
        return ViT(c.D, c.depth, c.heads, c.mlp, classes=len(SHAPES))
    return CharLM(vocab, c.context, c.D, c.depth, c.heads, c.mlp)


def _dump_probe(model, probe: torch.Tensor, path: str, meta: dict) -> None:
    """Saves, for the test that checks every logged kappa(J) against a dense SVD, the input X
    of every attention module at the probe (captured by hooks of this file, not the library's)
    and the effective qkv weight (with the correction)."""
    arrays: Dict[str, np.ndarray] = {}
    mods = [m for m in model.modules() if isinstance(m, Attention)]
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, i=i: arrays.__setitem__(f"X{i}", args[0][0].detach().double().numpy()))
        for i, m in enumerate(mods)]
    try:
        was = model.training
        model.eval()
        with torch.no_grad():
            model(probe)
        model.train(was)
    finally:
        for h in hooks:
            h.remove()
    for i, m in enumerate(mods):
        arrays[f"W{i}"] = m.qkv.weight.detach().double().numpy()
    np.savez(path, heads=np.array([m.num_heads for m in mods]),
             causal=np.array([m.causal for m in mods]), **arrays,
             **{k: np.array(v) for k, v in meta.items()})


def _evaluate(model, c: TaskConfig, x: torch.Tensor, y: torch.Tensor) -> Dict[str, float]:
    was = model.training
    model.eval()
    with torch.no_grad():
        losses, correct, n = 0.0, 0, 0
        for i in range(0, len(x), 256):
            out = model(x[i:i + 256])
            t = y[i:i + 256]
            if is_image(c.task):
                losses += F.cross_entropy(out, t, reduction="sum").item()
                correct += int((out.argmax(1) == t).sum())
                n += len(t)
            else:
                losses += F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1),
                                          reduction="sum").item()
                n += t.numel()
    model.train(was)
    r = {"test_loss": losses / n}
    r["test_accuracy"] = correct / n if is_image(c.task) else float("nan")
    return r


def _qkv_weights(model) -> List[torch.Tensor]:
    """The trainable qkv weight W of every attention module (under a correction, the
    parametrization's original, so W + C is what the forward pass uses)."""
    out = []
    for m in model.modules():
        if isinstance(m, Attention):
            p = getattr(getattr(m.qkv, "parametrizations", None), "weight", None)
            out.append((p.original if p is not None else m.qkv.weight).detach().clone())
    return out


def run(task: str, arm: str, seed: int, quick: bool = False, lr: Optional[float] = None,
        measure: bool = True, dump_dir: Optional[str] = None, split: str = "test") -> dict:
    """Trains one model and returns {"config", "epochs": [per-epoch metrics], "records":
    [KappaMonitor records]}. Single-threaded (torch.set_num_threads(1)), so a run is
    reproducible on one machine and runs beside another. split "valid": trained on the
    training data less a validation split and evaluated on that split (the learning-rate
    choice); "test": trained on all the training data and evaluated on the test split."""
    spec = arm_spec(arm)
    if split not in ("test", "valid"):
        raise ValueError(f"split must be 'test' or 'valid' (got {split!r})")
    torch.set_num_threads(1)
    c = task_config(task, quick, lr)
    if spec.escape:
        c.epochs *= 2
        c.lr = ESCAPE_LR
    if is_image(task):
        data = digits() if task == "vision" else shapes(*((400, 200) if quick else ()))
        if split == "valid":
            data = validation_split(data)
        train_x, train_y, test_x, test_y = data.train_x, data.train_y, data.test_x, data.test_y
        probe, vocab, source = test_x[:1], 0, data.source
        advise_input = train_x[:1]
    else:
        text = corpus()
        if split == "valid":
            text = corpus_validation(text)
        vocab, source = len(text.vocab), f"{text.source}, sha256 {text.sha256}"
        train_ids = text.train
        test_x, test_y = windows(text.valid, c.context, c.valid_windows)
        probe = test_x[:1]
        advise_input = windows(train_ids, c.context, 1)[0]
    mask = "causal" if task == "language" else "none"
    torch.manual_seed(seed)
    model = _build(c, vocab)
    advice = None
    if spec.advised:
        result = sct.advise(model, advise_input, lambdas=ADVISE_LAMBDAS,
                            placements=list(ADVISE_PLACEMENTS), heads="all", mask=mask)
        b = result.best
        advice = dict(found=bool(b.found), lam=float(b.lam) if b.found else float("nan"),
                      placement=b.placement if b.found else "", reason=b.reason)
        if b.found:
            sct.spectral_conditioning(model, advice=result)
    elif spec.method is not None:
        sct.spectral_conditioning(model, method=spec.method, lam=spec.lam,
                                  placement=spec.placement, refresh_every=spec.refresh_every)
    W0 = _qkv_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
    gen = torch.Generator().manual_seed(10_000 + seed)
    monitor = (sct.KappaMonitor(model, every=1, heads=None, budget_s=600.0, mask=mask, seed=seed)
               if measure else None)
    epochs: List[dict] = []
    records: List[dict] = []

    steps = 0

    def checkpoint(epoch: int, train_loss: float, train_s: float) -> None:
        row = dict(task=task, arm=arm, seed=seed, epoch=epoch, train_loss=train_loss,
                   train_seconds=train_s, lr=c.lr, steps=steps,
                   **_evaluate(model, c, test_x, test_y))
        # How far the trained W has moved, and how large it is, in spectral norm (max over
        # layers): W + lam E escapes lam E only where ||W|| reaches lam.
        W = _qkv_weights(model)
        row["W_norm"] = max(float(torch.linalg.matrix_norm(w, 2)) for w in W)
        row["W_move"] = max(float(torch.linalg.matrix_norm(w - w0, 2)) for w, w0 in zip(W, W0))
        t = time.perf_counter()
        if monitor is not None:
            records.extend(monitor.measure(probe, step=epoch, task=task, arm=arm, seed=seed,
                                           epoch=epoch))
        if dump_dir is not None:
            _dump_probe(model, probe, os.path.join(dump_dir, f"{task}_{arm}_s{seed}_e{epoch}.npz"),
                        dict(task=task, arm=arm, seed=seed, epoch=epoch))
        row["measure_seconds"] = time.perf_counter() - t
        epochs.append(row)

    diverged = False
    model.train()
    checkpoint(0, float("nan"), 0.0)
    for epoch in range(1, c.epochs + 1):
        t = time.perf_counter()
        total, count = 0.0, 0
        if is_image(task):
            order = torch.randperm(len(train_x), generator=gen)
            batches = [(train_x[order[i:i + c.batch]], train_y[order[i:i + c.batch]])
                       for i in range(0, len(order), c.batch)]
        else:
            starts = torch.randint(0, len(train_ids) - c.context - 1,
                                   (c.steps_per_epoch, c.batch), generator=gen)
            batches = [(torch.stack([train_ids[s:s + c.context] for s in row.tolist()]),
                        torch.stack([train_ids[s + 1:s + c.context + 1] for s in row.tolist()]))
                       for row in starts]
        for xb, yb in batches:
            out = model(xb)
            if is_image(task):
                loss = F.cross_entropy(out, yb)
            else:
                loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), yb.reshape(-1))
            if not math.isfinite(loss.item()):
                diverged = True  # recorded, not hidden: the run stops after this epoch
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            total += loss.item() * len(xb)
            count += len(xb)
        checkpoint(epoch, total / count if count else float("nan"), time.perf_counter() - t)
        if diverged:
            break
    return {"config": asdict(c), "source": source, "epochs": epochs, "records": records,
            "diverged": diverged, "advice": advice}
