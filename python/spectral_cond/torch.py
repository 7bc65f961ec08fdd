"""spectral_cond for PyTorch models: the paper's spectral conditioning as a drop-in, and a model
analysis from real activations (docs/python.md).

- spectral_conditioning(model, method="lambda"|"exact", lam=10, placement="fused"|"per_head"|
  "packed" (":qk"-style subsets too), refresh_every=None): adds a fixed, untrained correction C
  to the effective W_Q, W_K and W_V of every attention module, in every forward pass
  (torch.nn.utils.parametrize), so that gradients flow to W (MATH.md §6–7); the exact C is
  recomputed from the current W every k training forward passes (refresh_every=k, the paper's
  variant) or on demand (refresh(model)). remove(model, fold=True) folds W + C into the weights.
- analyze_model(model, inputs): per layer and head, kappa(W_Q), kappa(W_K), kappa(W_V) and
  kappa(J) at the module's real input, with the module's own masks, RoPE, biases and scale,
  each head checked against the module's own forward (or declined with the reason);
  ModelAnalysis.summary() condenses it per layer.
- advise(model, inputs): which lam and placement of lam I lower kappa(J) without saturating
  attention, from exact kappa(J) on a grid at the model's real activations (MATH.md §17);
  spectral_conditioning(model, advice=result) applies the recommendation.
- KappaMonitor(model, every=k, log=...): the same measurements every k training steps, at the
  current batch, to JSON lines or CSV, within a time budget per step.

Attention modules found (docs/python.md, "Models", has the table): nn.MultiheadAttention (hence
nn.TransformerEncoderLayer / DecoderLayer); timm's Attention (a `qkv` Linear); Hugging Face
attention with separate query/key/value, q_proj/k_proj/v_proj, q_lin/k_lin/v_lin or q/k/v
projections (BERT, RoBERTa, ViT, Llama, Mistral, Qwen2, Phi, T5, …) and with fused ones (GPT-2's
Conv1D c_attn, GPT-NeoX's query_key_value, Phi-3's qkv_proj). A torch Linear weight is out x in,
so the library's W (D x heads d) is weight.T; a Conv1D weight is in x out, W itself.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

import spectral_cond as sc
from ._torch_advise import advise
from ._torch_analysis import HeadAnalysis, ModelAnalysis, ModelSummary, analyze_model
from ._torch_monitor import KappaMonitor, read_monitor_log
from ._torch_sites import AttentionSite, Projection, find_attention

__all__ = [
    "advise",
    "AttentionSite",
    "HeadAnalysis",
    "KappaMonitor",
    "ModelAnalysis",
    "ModelSummary",
    "Projection",
    "analyze_model",
    "find_attention",
    "read_monitor_log",
    "refresh",
    "remove",
    "spectral_conditioning",
]


class FixedCorrection(nn.Module):
    """The parametrization W_eff = W + C with C a fixed buffer (never trained, MATH.md §7).
    `sources`: the projections (Projection, head_dim, layout) whose exact C refresh()
    recomputes from the current W."""

    def __init__(self, C: torch.Tensor, method: str, placement: str, sources=()):
        super().__init__()
        self.register_buffer("C", C)
        self.method = method
        self.placement = placement
        self.sources = list(sources)

    def forward(self, W: torch.Tensor) -> torch.Tensor:
        return W + self.C

    def extra_repr(self) -> str:
        return f"method={self.method!r}, placement={self.placement!r}, shape={tuple(self.C.shape)}"


def _correction(p: Projection, d: int, method: str, lam: float, layout: str,
                W: np.ndarray = None) -> np.ndarray:
    """C for the library's W (D x heads d; read from the parameter unless given), as a float64
    array of that shape. layout 'packed': the rectangular identity of the packed parameter in its
    own storage (eye(3D, D) on a Linear's out x in weight), which at this projection's output
    features f_j puts lam at row f_j of column j where f_j < D."""
    W = p.W() if W is None else W
    D = W.shape[0]
    if layout == "packed":
        C = np.zeros_like(W)
        for j, f in enumerate(p.features):
            if f < D:
                C[int(f), j] = lam
        return C
    if method == "lambda":
        return lam * sc.lambda_identity(D, p.heads, d, "fused" if layout == "fused" else "per-head")
    if layout == "fused":
        return sc.exact_correction(W).C
    C = np.zeros_like(W)
    for j in range(p.heads):
        C[:, j * d:(j + 1) * d] = sc.exact_correction(W[:, j * d:(j + 1) * d]).C
    return C


_SAVE_MESSAGE = (
    "a spectrally conditioned module cannot be pickled whole (torch.save(model)): save "
    "model.state_dict() instead (it holds W, C and the folded W + C, and loads into a plain or a "
    "conditioned model), or call spectral_cond.torch.remove(model, fold=True) first to make "
    "W + C the plain weights")


def _refuse_pickle(self):
    raise RuntimeError("spectral_cond.torch: " + _SAVE_MESSAGE)


class _FoldedStateDict:
    """state_dict hook: the state dict also holds the folded W + C under the plain name, so that
    a plain model (or Hugging Face's from_pretrained) loads the function the conditioned model
    computes. A class, not a closure, so that the hook pickles with its module."""

    _spectral_cond = True

    def __init__(self, param: str):
        self.param = param

    def __call__(self, module, state_dict, prefix, local_metadata):
        if parametrize.is_parametrized(module, self.param):
            state_dict[prefix + self.param] = getattr(module, self.param).detach().clone()


class _LoadFolded:
    """load_state_dict pre-hook: a conditioned module loads W and C from their own keys; the
    folded copy is dropped after checking that it is W + C (a mismatch is an error, not a silent
    choice)."""

    _spectral_cond = True

    def __init__(self, param: str):
        self.param = param

    def __call__(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 errors):
        param = self.param
        folded = state_dict.get(prefix + param)
        orig = state_dict.get(prefix + f"parametrizations.{param}.original")
        corr = state_dict.get(prefix + f"parametrizations.{param}.0.C")
        if folded is None or orig is None or corr is None:
            return
        state_dict.pop(prefix + param)
        want = (orig.to(torch.float64) + corr.to(torch.float64)).to(folded.dtype)
        if not torch.equal(folded, want):
            errors.append(f"spectral_cond: {prefix}{param} (the folded W + C) is not "
                          f"{prefix}parametrizations.{param}.original + C in this state dict")


class _ExactRefresh:
    """Forward pre-hook of the conditioned model: before every k-th forward pass in training
    mode after the first, the exact C is recomputed from the current W (refresh). Between
    refreshes C is a constant, so the gradient stays dL/d(W + C)."""

    _spectral_cond = True

    def __init__(self, every: int):
        self.every = every
        self.calls = 0

    def __call__(self, module, args):
        if not module.training:
            return
        if self.calls > 0 and self.calls % self.every == 0:
            refresh(module)
        self.calls += 1


def refresh(model: nn.Module) -> int:
    """Recomputes every exact correction C of a spectrally conditioned model from the current
    weights W (the paper's variant of Theorem 3.5's correction, which follows W in training);
    lambda corrections are fixed and left alone. Returns the number of parameters refreshed."""
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if not parametrize.is_parametrized(m):
                continue
            for param, plist in m.parametrizations.items():
                for f in plist:
                    if not (isinstance(f, FixedCorrection) and f.method == "exact"):
                        continue
                    W = plist.original
                    C = torch.zeros(W.shape, dtype=torch.float64)
                    for p, d, layout in f.sources:
                        p.place(C, _correction(p, d, "exact", 0.0, layout, W=p.W(W)))
                    f.C.copy_(C.to(device=f.C.device, dtype=f.C.dtype))
                    n += 1
    return n


def spectral_conditioning(model: nn.Module, method: str = "lambda", lam: float = 10.0,
                          placement: str = "fused", advice=None,
                          refresh_every=None) -> nn.Module:
    """Spectrally conditioned attention (the paper's method, MATH.md §6–7), in place.

    Every attention module's effective W_Q, W_K and W_V become W + C in every forward pass, C
    fixed and not trained, so dL/dW = dL/dW_eff. method "lambda": C = lam E (Theorem 3.8), E the
    rectangular identity of the fused D x (heads d) projection (placement "fused"), of each
    head's D x d block ("per_head"), or of the packed [Q; K; V] parameter itself ("packed":
    timm's qkv, in_proj_weight, GPT-2's c_attn, which puts I on the Q block alone); a subset of
    the projections is named after a colon ("fused:qk", "per_head:v"). method "exact": C =
    sigma_1 U V^T of the current weights (Theorem 3.5), fused or per head block, computed here
    and then fixed, or recomputed from the current W before every refresh_every-th forward pass
    in training mode (the paper's variant; refresh(model) does it on demand). advice: the result of spectral_cond.torch.advise, whose recommended
    lam and placement are applied (an error, with its reason, when it recommends none).
    Returns `model`.

    Saving (docs/python.md, "Saving a conditioned model"): model.state_dict() holds W and C under
    the parametrization's keys and the folded W + C under the plain name, so it loads into a
    model conditioned the same way (W and C restored) and into a plain one, including Hugging
    Face's save_pretrained / from_pretrained (W + C as its weights). torch.save(model) is
    refused with a message that names remove(model, fold=True).

    lam = 10 (the paper's value) saturates the softmax of LayerNorm'd models at initialisation
    (logits about lam^2 sqrt(d_k)): advise(model, batch) says which lam and placement do not;
    docs/reproduction.md has the measurements.
    """
    fn = "spectral_conditioning"
    if advice is not None:
        best = getattr(advice, "best", None)
        if best is None or not hasattr(best, "found"):
            raise TypeError(f"{fn}: advice must be the result of spectral_cond.torch.advise")
        if not best.found:
            raise ValueError(f"{fn}: the advice recommends no lambda ({best.reason})")
        method, lam, placement = "lambda", float(best.lam), best.placement
    if method not in ("lambda", "exact"):
        raise ValueError(f"{fn}: method must be 'lambda' or 'exact' (got {method!r})")
    try:
        canonical = sc._core.placement_name(placement) if isinstance(placement, str) else None
    except ValueError as e:
        raise ValueError(f"{fn}: {e}") from None
    if canonical is None:
        raise ValueError(f"{fn}: placement must be a string such as 'fused' (got {placement!r})")
    layout, _, subset = canonical.partition(":")
    subset = subset or "qkv"
    if method == "exact" and layout == "packed":
        raise ValueError(f"{fn}: the exact correction has no packed placement (use 'fused' or "
                         "'per_head')")
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"{fn}: lam must be finite and >= 0 (got {lam!r})")
    if refresh_every is not None:
        if method != "exact":
            raise ValueError(f"{fn}: refresh_every applies to method 'exact' only (the lambda "
                             "correction depends on shapes alone)")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or \
                refresh_every < 1:
            raise ValueError(f"{fn}: refresh_every must be an integer >= 1 (got "
                             f"{refresh_every!r})")
    sites = find_attention(model)
    if not sites:
        raise ValueError(f"{fn}: the model has no attention module spectral_cond "
                         "knows (docs/python.md, 'Models', lists them)")
    if layout == "packed":
        for s in sites:
            if not (s.q.owner is s.k.owner is s.v.owner and s.q.param == s.k.param == s.v.param):
                raise ValueError(f"{fn}: placement 'packed' needs Q, K and V in one parameter, "
                                 f"but {s.name} has separate query/key/value weights")
    # One fixed addend per parameter tensor (a fused qkv weight holds three projections).
    addends: Dict[Tuple[int, str], Tuple[nn.Module, str, torch.Tensor]] = {}
    sources: Dict[Tuple[int, str], list] = {}
    for s in sites:
        for letter, p in (("q", s.q), ("k", s.k), ("v", s.v)):
            if parametrize.is_parametrized(p.owner, p.param):
                raise ValueError(
                    f"spectral_conditioning: {s.name}.{p.param} is already parametrized "
                    "(call spectral_cond.torch.remove(model) first)")
            key = (id(p.owner), p.param)
            if key not in addends:
                t = p.tensor()
                addends[key] = (p.owner, p.param, torch.zeros(t.shape, dtype=torch.float64))
            if letter in subset:
                p.place(addends[key][2], _correction(p, s.head_dim, method, lam, layout))
                sources.setdefault(key, []).append((p, s.head_dim, layout))
    for key, (owner, param, C) in addends.items():
        t = getattr(owner, param)
        parametrize.register_parametrization(
            owner, param, FixedCorrection(C.to(device=t.device, dtype=t.dtype), method, canonical,
                                          sources.get(key, ()) if method == "exact" else ()))
        type(owner).__getstate__ = _refuse_pickle
        owner.register_state_dict_post_hook(_FoldedStateDict(param))
        owner.register_load_state_dict_pre_hook(_LoadFolded(param))
    if refresh_every is not None:
        model.register_forward_pre_hook(_ExactRefresh(refresh_every))
    return model


def _drop_hooks(m: nn.Module) -> None:
    """Removes this module's state-dict hooks of spectral_conditioning (found by a mark on the
    functions, which a deep copy keeps, rather than by handles, which it would share)."""
    for name in ("_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_pre_hooks"):
        hooks = getattr(m, name, None)
        if not hooks:
            continue
        for k in [k for k, h in hooks.items()
                  if getattr(getattr(h, "hook", h), "_spectral_cond", False)]:
            del hooks[k]


def remove(model: nn.Module, fold: bool = True) -> nn.Module:
    """Removes the corrections of spectral_conditioning: fold=True leaves W + C as the weights
    (for inference, or to save the model as a plain one), fold=False restores W. Returns
    `model`."""
    found = False
    for m in model.modules():
        if not parametrize.is_parametrized(m):
            continue
        # A deep copy of a parametrized module shares its generated class with the original,
        # and removing a parametrization deletes a property of that class: give this module a
        # class of its own first, so that the copy and the original stay independent.
        cls = m.__class__
        m.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
        for param in list(m.parametrizations.keys()):
            plist = m.parametrizations[param]
            if any(isinstance(f, FixedCorrection) for f in plist):
                if len(plist) != 1:
                    raise ValueError(
                        f"spectral_cond.torch.remove: {param} has other parametrizations too")
                parametrize.remove_parametrizations(m, param, leave_parametrized=fold)
                found = True
        if not parametrize.is_parametrized(m):
            _drop_hooks(m)
    if found:
        _drop_hooks(model)  # refresh_every's hook
    if not found:
        raise ValueError("spectral_cond.torch.remove: the model is not spectrally conditioned")
    return model
