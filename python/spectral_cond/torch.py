"""spectral_cond for PyTorch models: the paper's spectral conditioning as a drop-in, and a model
analysis from real activations.

- spectral_conditioning(model, method="lambda"|"exact", lam=10, placement="fused"|"per-head"):
  adds a fixed, untrained correction C to the effective W_Q, W_K and W_V of every attention
  module, in every forward pass (torch.nn.utils.parametrize), so that gradients flow to W
  (MATH.md §6–7). remove(model, fold=True) folds W + C into the weights.
- analyze_model(model, inputs): captures each attention module's input X by forward hooks and
  reports, per layer and head, kappa(W_Q), kappa(W_K), kappa(W_V) and kappa(J) at that X.

Attention modules found: nn.MultiheadAttention (in_proj_weight, 3D x D with row blocks Q, K, V,
or separate q/k/v_proj_weight), hence nn.TransformerEncoderLayer and nn.TransformerDecoderLayer
through their attention members; timm-style attention (a `qkv` nn.Linear and `num_heads`); and
Hugging Face style attention with separate `query`/`key`/`value` or `q_proj`/`k_proj`/`v_proj`
Linears. A torch Linear weight is out x in, so the library's W (D x heads d) is weight.T.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

import spectral_cond as sc
from ._results import JacobianConditionResult, _Result

__all__ = [
    "AttentionSite",
    "HeadAnalysis",
    "ModelAnalysis",
    "analyze_model",
    "find_attention",
    "remove",
    "spectral_conditioning",
]


@dataclass
class Projection:
    """Where one of W_Q, W_K, W_V lives: rows [row0, row1) of `owner.<param>` (a weight of
    shape out x in, so W = weight[row0:row1].T, D x heads d)."""

    owner: nn.Module
    param: str
    row0: int
    row1: int
    heads: int

    def weight(self) -> torch.Tensor:
        return getattr(self.owner, self.param)[self.row0:self.row1]

    def W(self) -> np.ndarray:
        """The library's W (D x heads d), float64, in Fortran order (read without a copy)."""
        return self.weight().detach().to("cpu", torch.float64).numpy().T


@dataclass
class AttentionSite:
    """One attention module of a model and where its projections live."""

    name: str
    module: nn.Module
    kind: str  # "nn.MultiheadAttention", "timm", "huggingface"
    D: int
    heads: int
    kv_heads: int
    head_dim: int
    q: Projection
    k: Projection
    v: Projection
    scale: Optional[float]  # None: the library's default 1/sqrt(d_k)
    has_bias: bool
    rope: bool
    notes: List[str]


def _first_int(module: nn.Module, names: Sequence[str]) -> Optional[int]:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    config = getattr(module, "config", None)
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _float_attr(module: nn.Module, names: Sequence[str]) -> Optional[float]:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return float(v)
    return None


def _has_rope(module: nn.Module) -> bool:
    if any(hasattr(module, a) for a in ("rotary_emb", "rotary", "rope", "rotary_fn")):
        return True
    try:
        return "position_embeddings" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _qk_norm_note(module: nn.Module) -> Optional[str]:
    for a in ("q_norm", "k_norm"):
        m = getattr(module, a, None)
        if isinstance(m, nn.Module) and not isinstance(m, nn.Identity):
            return f"the module normalises queries/keys ({a}); kappa(J) ignores that normalisation"
    return None


def _site(name: str, m: nn.Module) -> Optional[AttentionSite]:
    if isinstance(m, nn.MultiheadAttention):
        D, H = m.embed_dim, m.num_heads
        d = D // H
        if m._qkv_same_embed_dim:
            q = Projection(m, "in_proj_weight", 0, D, H)
            k = Projection(m, "in_proj_weight", D, 2 * D, H)
            v = Projection(m, "in_proj_weight", 2 * D, 3 * D, H)
        else:
            q = Projection(m, "q_proj_weight", 0, D, H)
            k = Projection(m, "k_proj_weight", 0, D, H)
            v = Projection(m, "v_proj_weight", 0, D, H)
        notes = []
        if not m._qkv_same_embed_dim:
            notes.append("separate kdim/vdim: key and value inputs differ from the query's")
        has_bias = m.in_proj_bias is not None or m.bias_k is not None
        return AttentionSite(name, m, "nn.MultiheadAttention", D, H, H, d, q, k, v, None,
                             has_bias, False, notes)
    qkv = getattr(m, "qkv", None)
    if isinstance(qkv, nn.Linear):
        H = _first_int(m, ("num_heads", "num_attention_heads", "n_heads"))
        if H is None or qkv.out_features % 3 != 0:
            return None
        D = qkv.in_features
        hd3 = qkv.out_features // 3
        d = _first_int(m, ("head_dim",)) or hd3 // H
        if d * H != hd3:
            return None
        q = Projection(qkv, "weight", 0, hd3, H)
        k = Projection(qkv, "weight", hd3, 2 * hd3, H)
        v = Projection(qkv, "weight", 2 * hd3, 3 * hd3, H)
        notes = [n for n in [_qk_norm_note(m)] if n]
        return AttentionSite(name, m, "timm", D, H, H, d, q, k, v,
                             _float_attr(m, ("scale", "scaling")), qkv.bias is not None,
                             _has_rope(m), notes)
    for qn, kn, vn in (("query", "key", "value"), ("q_proj", "k_proj", "v_proj")):
        lq, lk, lv = (getattr(m, n, None) for n in (qn, kn, vn))
        if not all(isinstance(x, nn.Linear) for x in (lq, lk, lv)):
            continue
        H = _first_int(m, ("num_attention_heads", "num_heads", "n_heads", "n_head"))
        if H is None:
            raise ValueError(
                f"spectral_cond.torch: {name} has {qn}/{kn}/{vn} Linears but no head count "
                "(num_attention_heads, num_heads or config.num_attention_heads)")
        D = lq.in_features
        d = _first_int(m, ("attention_head_size", "head_dim")) or lq.out_features // H
        if d * H != lq.out_features or lk.out_features % d or lk.out_features != lv.out_features:
            raise ValueError(
                f"spectral_cond.torch: {name}: {qn} has {lq.out_features} outputs, not "
                f"{H} heads x {d}")
        KV = lk.out_features // d
        q = Projection(lq, "weight", 0, lq.out_features, H)
        k = Projection(lk, "weight", 0, lk.out_features, KV)
        v = Projection(lv, "weight", 0, lv.out_features, KV)
        has_bias = any(x.bias is not None for x in (lq, lk, lv))
        notes = [n for n in [_qk_norm_note(m)] if n]
        return AttentionSite(name, m, "huggingface", D, H, KV, d, q, k, v,
                             _float_attr(m, ("scaling",)), has_bias, _has_rope(m), notes)
    return None


def find_attention(model: nn.Module) -> List[AttentionSite]:
    """Every attention module of `model` that spectral_cond knows, in module order."""
    sites = []
    for name, m in model.named_modules():
        s = _site(name, m)
        if s is not None:
            sites.append(s)
    return sites


class FixedCorrection(nn.Module):
    """The parametrization W_eff = W + C with C a fixed buffer (never trained, MATH.md §7)."""

    def __init__(self, C: torch.Tensor, method: str, placement: str):
        super().__init__()
        self.register_buffer("C", C)
        self.method = method
        self.placement = placement

    def forward(self, W: torch.Tensor) -> torch.Tensor:
        return W + self.C

    def extra_repr(self) -> str:
        return f"method={self.method!r}, placement={self.placement!r}, shape={tuple(self.C.shape)}"


def _correction(p: Projection, d: int, method: str, lam: float, placement: str) -> np.ndarray:
    """C for the library's W = weight[rows].T (D x heads d), as a float64 array of that shape."""
    D = getattr(p.owner, p.param).shape[1]
    if method == "lambda":
        return lam * sc.lambda_identity(D, p.heads, d, placement)
    W = p.W()
    if placement == "fused":
        return sc.exact_correction(W).C
    C = np.zeros_like(W)
    for j in range(p.heads):
        C[:, j * d:(j + 1) * d] = sc.exact_correction(W[:, j * d:(j + 1) * d]).C
    return C


def spectral_conditioning(model: nn.Module, method: str = "lambda", lam: float = 10.0,
                          placement: str = "fused") -> nn.Module:
    """Spectrally conditioned attention (the paper's method, MATH.md §6–7), in place.

    Every attention module's effective W_Q, W_K and W_V become W + C in every forward pass, C
    fixed and not trained, so dL/dW = dL/dW_eff. method "lambda": C = lam E, E the rectangular
    identity of the fused D x (heads d) projection (placement "fused") or of each head's D x d
    block ("per-head"), Theorem 3.8. method "exact": C = sigma_1 U V^T of the current weights
    (Theorem 3.5), fused or per head block, computed once here and then fixed. Returns `model`.
    """
    if method not in ("lambda", "exact"):
        raise ValueError(f"spectral_conditioning: method must be 'lambda' or 'exact' (got {method!r})")
    if placement == "per_head":
        placement = "per-head"
    if placement not in ("fused", "per-head"):
        raise ValueError(
            f"spectral_conditioning: placement must be 'fused' or 'per-head' (got {placement!r})")
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"spectral_conditioning: lam must be finite and >= 0 (got {lam!r})")
    sites = find_attention(model)
    if not sites:
        raise ValueError("spectral_conditioning: the model has no attention module spectral_cond "
                         "knows (nn.MultiheadAttention, timm qkv, Hugging Face query/key/value)")
    # One fixed addend per parameter tensor (a fused qkv weight holds three projections).
    addends: Dict[Tuple[int, str], Tuple[nn.Module, str, torch.Tensor]] = {}
    for s in sites:
        for p in (s.q, s.k, s.v):
            if parametrize.is_parametrized(p.owner, p.param):
                raise ValueError(
                    f"spectral_conditioning: {s.name}.{p.param} is already parametrized "
                    "(call spectral_cond.torch.remove(model) first)")
            key = (id(p.owner), p.param)
            if key not in addends:
                t = getattr(p.owner, p.param)
                addends[key] = (p.owner, p.param, torch.zeros(t.shape, dtype=torch.float64))
            C = _correction(p, s.head_dim, method, lam, placement)
            addends[key][2][p.row0:p.row1] = torch.from_numpy(np.ascontiguousarray(C.T))
    for owner, param, C in addends.values():
        t = getattr(owner, param)
        parametrize.register_parametrization(
            owner, param, FixedCorrection(C.to(device=t.device, dtype=t.dtype), method, placement))
    return model


def remove(model: nn.Module, fold: bool = True) -> nn.Module:
    """Removes the corrections of spectral_conditioning: fold=True leaves W + C as the weights
    (for inference), fold=False restores W. Returns `model`."""
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
    if not found:
        raise ValueError("spectral_cond.torch.remove: the model is not spectrally conditioned")
    return model


@dataclass(repr=False)
class HeadAnalysis(_Result):
    """One head of one attention layer: kappa of its weights and kappa(J) at the captured X."""

    layer: int
    name: str
    kind: str
    head: int
    kv_head: int
    N: int
    D: int
    d_k: int
    d_v: int
    scale: float
    kappa_WQ: float
    kappa_WK: float
    kappa_WV: float
    kappa_J: float
    kappa_plus_J: float
    method: str
    accuracy: float
    info: str
    has_bias: bool
    rope: bool
    note: str
    jacobian: Optional[JacobianConditionResult]

    _repr_fields = ("layer", "head", "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_J", "method",
                    "accuracy")


class ModelAnalysis(list):
    """The list of HeadAnalysis results of analyze_model, with to_pandas()."""

    def to_pandas(self):
        try:
            import pandas as pd
        except ImportError as e:  # pandas is optional
            raise ImportError("ModelAnalysis.to_pandas needs pandas (pip install pandas)") from e
        rows = []
        for r in self:
            d = r.to_dict()
            d.pop("jacobian")
            rows.append(d)
        return pd.DataFrame(rows)


def _captured_input(site: AttentionSite, args: tuple, kwargs: dict) -> Tuple[Any, str]:
    """The attention module's input X (tokens x D, batched or not) and a note."""
    note = ""
    if site.kind == "nn.MultiheadAttention":
        names = ("query", "key", "value")
        vals = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
        q, k, v = vals
        if not (k is q and v is q):
            if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
                    and k.shape == q.shape and v.shape == q.shape
                    and torch.equal(k, q) and torch.equal(v, q)):
                note = "key/value inputs differ from the query (cross-attention)"
        x = q
        if x.dim() == 3 and not site.module.batch_first:
            x = x.transpose(0, 1)
        return x, note
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    return x, note


def analyze_model(model: nn.Module, inputs: Any, method: str = "auto", tol: float = 1e-6,
                  mask: str = "none", sample: int = 0, jacobian: bool = True,
                  layers: Optional[Iterable[int]] = None,
                  progress: Optional[Callable[[float], Any]] = None) -> ModelAnalysis:
    """Runs `model` on `inputs` (a tensor, a tuple of positional arguments, or a dict of keyword
    arguments) without gradients, captures each attention module's input X (sample `sample` of
    the batch) by forward hooks, and returns per layer and head kappa(W_Q), kappa(W_K),
    kappa(W_V) (the head's D x d block, MATH.md §4) and kappa(J) of that head at X
    (kappa_jacobian with `method` and `tol`, MATH.md §12; the result carries the method used
    and its accuracy). Biases, RoPE and query/key normalisation are not in the library's
    attention: such modules are flagged (has_bias, rope) and their note says that kappa(J)
    ignores them. `mask` ('none' or 'causal') is the mask kappa(J) uses. `progress` is called
    with the fraction of heads done.
    """
    sites = find_attention(model)
    if not sites:
        raise ValueError("analyze_model: the model has no attention module spectral_cond knows")
    wanted = None if layers is None else set(layers)
    captured: Dict[int, Tuple[Any, str]] = {}
    handles = []
    for i, s in enumerate(sites):
        def hook(module, args, kwargs, i=i, s=s):
            if i not in captured:
                x, note = _captured_input(s, args, kwargs)
                captured[i] = (x.detach(), note)
        handles.append(s.module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            if isinstance(inputs, dict):
                model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    finally:
        for h in handles:
            h.remove()
    todo = [(i, s) for i, s in enumerate(sites) if wanted is None or i in wanted]
    total = sum(s.heads for _, s in todo) or 1
    done = 0
    out = ModelAnalysis()
    for i, s in todo:
        X = None
        base_notes = list(s.notes)
        if i not in captured:
            base_notes.append("the module did not run on these inputs: no X, kappa(J) not computed")
        else:
            x, cnote = captured[i]
            if cnote:
                base_notes.append(cnote + ": kappa(J) of self-attention not computed")
            else:
                if x.dim() == 3:
                    x = x[sample]
                X = x.to("cpu", torch.float64).numpy()
        if s.has_bias:
            base_notes.append("the module has biases; kappa(J) ignores them (not in the library yet)")
        if s.rope:
            base_notes.append("the module applies rotary position embeddings (RoPE); kappa(J) "
                              "ignores them (not in the library yet)")
        WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
        d = s.head_dim
        group = s.heads // s.kv_heads
        for h in range(s.heads):
            g = h // group
            wq = WQ[:, h * d:(h + 1) * d]
            wk = WK[:, g * d:(g + 1) * d]
            wv = WV[:, g * d:(g + 1) * d]
            notes = list(base_notes)
            J = None
            if jacobian and X is not None:
                J = sc.kappa_jacobian(X, wq, wk, wv, method=method, tol=tol, scale=s.scale,
                                      mask=mask)
                if J.note:
                    notes.append(J.note)
            nan = float("nan")
            out.append(HeadAnalysis(
                layer=i, name=s.name, kind=s.kind, head=h, kv_head=g,
                N=0 if X is None else X.shape[0], D=s.D, d_k=d, d_v=d,
                scale=s.scale if s.scale is not None else 1.0 / math.sqrt(d),
                kappa_WQ=sc.kappa(wq).kappa, kappa_WK=sc.kappa(wk).kappa,
                kappa_WV=sc.kappa(wv).kappa,
                kappa_J=J.kappa if J else nan, kappa_plus_J=J.kappa_plus if J else nan,
                method=J.method if J else "", accuracy=J.accuracy if J else nan,
                info=J.info if J else "not_computed", has_bias=s.has_bias, rope=s.rope,
                note="; ".join(notes), jacobian=J))
            done += 1
            if progress is not None:
                progress(done / total)
    return out
