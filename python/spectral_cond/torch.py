"""spectral_cond for PyTorch models: the paper's spectral conditioning as a drop-in, and a model
analysis from real activations.

- spectral_conditioning(model, method="lambda"|"exact", lam=10, placement="fused"|"per-head"):
  adds a fixed, untrained correction C to the effective W_Q, W_K and W_V of every attention
  module, in every forward pass (torch.nn.utils.parametrize), so that gradients flow to W
  (MATH.md §6–7). remove(model, fold=True) folds W + C into the weights.
- analyze_model(model, inputs): captures each attention module's input X by forward hooks and
  reports, per layer and head, kappa(W_Q), kappa(W_K), kappa(W_V) and kappa(J) at that X, with
  the attention diagnostics.
- KappaMonitor(model, every=k, log=...): the same measurements every k training steps, at the
  current batch, to JSON lines or CSV, within a time budget per step.

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
from ._results import AttentionDiagnostics, JacobianConditionResult, _Result

__all__ = [
    "AttentionSite",
    "HeadAnalysis",
    "KappaMonitor",
    "ModelAnalysis",
    "analyze_model",
    "find_attention",
    "read_monitor_log",
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
    bias_param: Optional[str] = None  # the owner's bias parameter, rows bias_row0 onwards
    bias_row0: int = 0

    def weight(self) -> torch.Tensor:
        return getattr(self.owner, self.param)[self.row0:self.row1]

    def b(self) -> Optional[np.ndarray]:
        """The projection's bias (float64 vector), or None."""
        if self.bias_param is None:
            return None
        t = getattr(self.owner, self.bias_param, None)
        if t is None:
            return None
        n = self.row1 - self.row0
        return t[self.bias_row0:self.bias_row0 + n].detach().to("cpu", torch.float64).numpy()

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
            q = Projection(m, "in_proj_weight", 0, D, H, "in_proj_bias", 0)
            k = Projection(m, "in_proj_weight", D, 2 * D, H, "in_proj_bias", D)
            v = Projection(m, "in_proj_weight", 2 * D, 3 * D, H, "in_proj_bias", 2 * D)
        else:
            q = Projection(m, "q_proj_weight", 0, D, H, "in_proj_bias", 0)
            k = Projection(m, "k_proj_weight", 0, D, H, "in_proj_bias", D)
            v = Projection(m, "v_proj_weight", 0, D, H, "in_proj_bias", 2 * D)
        notes = []
        if not m._qkv_same_embed_dim:
            notes.append("separate kdim/vdim: key and value inputs differ from the query's")
        if m.bias_k is not None:
            notes.append("add_bias_kv appends a learned key/value token; kappa(J) ignores it")
        has_bias = m.in_proj_bias is not None
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
        q = Projection(qkv, "weight", 0, hd3, H, "bias", 0)
        k = Projection(qkv, "weight", hd3, 2 * hd3, H, "bias", hd3)
        v = Projection(qkv, "weight", 2 * hd3, 3 * hd3, H, "bias", 2 * hd3)
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
        q = Projection(lq, "weight", 0, lq.out_features, H, "bias")
        k = Projection(lk, "weight", 0, lk.out_features, KV, "bias")
        v = Projection(lv, "weight", 0, lv.out_features, KV, "bias")
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
    """One head of one attention layer: kappa of its weights and kappa(J) at the captured X,
    with the attention diagnostics (MATH.md §11) when they were computed."""

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
    diagnostics: Optional[AttentionDiagnostics] = None

    _repr_fields = ("layer", "head", "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_J", "method",
                    "accuracy")

    def flat(self) -> dict:
        """One flat row: the fields above without the nested results, and the diagnostics'
        main figures (NaN / None when they were not computed)."""
        d = self.to_dict()
        d.pop("jacobian")
        d.pop("diagnostics")
        g = self.diagnostics
        nan = float("nan")
        d["row_max_mean"] = g.row_max_mean if g else nan
        d["entropy_mean"] = g.entropy_mean if g else nan
        d["saturated_fraction"] = g.saturated_fraction if g else nan
        d["ratio_QK_V"] = g.ratio_QK_V if g else nan
        d["collapsed"] = g.collapsed if g else None
        d["free_bound"] = g.free_bound.bound if g and g.free_bound else nan
        return d


class ModelAnalysis(list):
    """The list of HeadAnalysis results of analyze_model, with to_pandas()."""

    def to_pandas(self):
        """A pandas DataFrame with one row per head (HeadAnalysis.flat())."""
        try:
            import pandas as pd
        except ImportError as e:  # pandas is optional
            raise ImportError("ModelAnalysis.to_pandas needs pandas (pip install pandas)") from e
        return pd.DataFrame([r.flat() for r in self])


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


def _run(model: nn.Module, inputs: Any) -> None:
    if isinstance(inputs, dict):
        model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    else:
        model(inputs)


def _capture(model: nn.Module, sites: List[AttentionSite], inputs: Any,
             probe: bool = False) -> Dict[int, Tuple[Any, str]]:
    """Runs `model` on `inputs` without gradients and returns, per site index, the input X its
    attention module saw (the first call) and a note. probe=True runs it in eval mode (no
    dropout) with the global random state saved and restored, so that a measurement during
    training changes neither the model's mode nor the random numbers training draws next."""
    captured: Dict[int, Tuple[Any, str]] = {}
    handles = []
    for i, s in enumerate(sites):
        def hook(module, args, kwargs, i=i, s=s):
            if i not in captured:
                x, note = _captured_input(s, args, kwargs)
                captured[i] = (x.detach(), note)
        handles.append(s.module.register_forward_pre_hook(hook, with_kwargs=True))
    was_training = model.training
    # In eval mode without gradients nn.TransformerEncoderLayer and nn.MultiheadAttention take
    # a fused "fast path" that never calls the attention module's forward (nor its hooks).
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    try:
        if fast is not None:
            mha.set_fastpath_enabled(False)
        with torch.no_grad():
            if probe:
                model.eval()
                with torch.random.fork_rng(devices=[]):
                    _run(model, inputs)
            else:
                _run(model, inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        if fast is not None:
            mha.set_fastpath_enabled(fast)
    return captured


def _site_X(site: AttentionSite, captured: Dict[int, Tuple[Any, str]], i: int,
            sample: int) -> Tuple[Optional[np.ndarray], List[str]]:
    """The float64 X of site i (sample `sample` of a batch) and the notes that go with it."""
    notes = list(site.notes)
    X = None
    if i not in captured:
        notes.append("the module did not run on these inputs: no X, kappa(J) not computed")
    else:
        x, cnote = captured[i]
        if cnote:
            notes.append(cnote + ": kappa(J) of self-attention not computed")
        else:
            if x.dim() == 3:
                x = x[sample]
            X = x.to("cpu", torch.float64).numpy()
    if site.rope and _rope_of(site) is None:
        notes.append("the module applies rotary position embeddings (RoPE) whose settings "
                     "(config.rope_theta without rope_scaling) were not found; kappa(J) ignores "
                     "them")
    return X, notes


def _rope_of(site: AttentionSite) -> Optional[sc.Rope]:
    """Hugging Face's rotate_half RoPE at positions 0, 1, … from the module's config, where it
    is the plain one (no rope_scaling; partial_rotary_factor honoured); else None."""
    if not site.rope or site.kind != "huggingface":
        return None
    config = getattr(site.module, "config", None)
    theta = getattr(config, "rope_theta", None)
    if not isinstance(theta, (int, float)) or getattr(config, "rope_scaling", None):
        return None
    factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    dims = int(site.head_dim * factor)
    return sc.Rope("rotate_half", theta=float(theta), dims=0 if dims == site.head_dim else dims)


def _head_extras(site: AttentionSite, h: int) -> Tuple[Any, Optional[sc.Rope]]:
    """Head h's slices of the module's Q/K/V biases (None without biases) and its RoPE."""
    d = site.head_dim
    g = h // (site.heads // site.kv_heads)
    bs = (site.q.b(), site.k.b(), site.v.b())
    biases = None
    if any(b is not None for b in bs):
        biases = tuple(None if b is None else b[j * d:(j + 1) * d] for b, j in zip(bs, (h, g, g)))
    return biases, _rope_of(site)


def _head_weights(site: AttentionSite, WQ: np.ndarray, WK: np.ndarray, WV: np.ndarray,
                  h: int) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    d = site.head_dim
    g = h // (site.heads // site.kv_heads)
    return (g, WQ[:, h * d:(h + 1) * d], WK[:, g * d:(g + 1) * d], WV[:, g * d:(g + 1) * d])


# kappa of the weights by LAPACK's gesdd where the library has it: numpy's SVD, the same
# accuracy (kappa to about eps kappa), and 7x faster than the Jacobi SVD kappa() picks by default
# for matrices of <= 64 columns (a head's block; bench/python/bench_models.py).
_WEIGHT_SVD = "lapack" if sc._core.have_lapacke() else "auto"


def _weight_kappa(W) -> float:
    return sc.kappa(W, svd=_WEIGHT_SVD).kappa


def analyze_model(model: nn.Module, inputs: Any, method: str = "auto", tol: float = 1e-6,
                  mask: str = "none", sample: int = 0, jacobian: bool = True,
                  layers: Optional[Iterable[int]] = None,
                  progress: Optional[Callable[[float], Any]] = None,
                  diagnostics: bool = True) -> ModelAnalysis:
    """Runs `model` on `inputs` (a tensor, a tuple of positional arguments, or a dict of keyword
    arguments) without gradients, captures each attention module's input X (sample `sample` of
    the batch) by forward hooks, and returns per layer and head kappa(W_Q), kappa(W_K),
    kappa(W_V) (the head's D x d block, MATH.md §4) and kappa(J) of that head at X
    (kappa_jacobian with `method` and `tol`, MATH.md §12; the result carries the method used
    and its accuracy), with the attention diagnostics (MATH.md §11: the pattern, J's block
    norms, the bound without hypothesis) when `diagnostics`. Biases, RoPE and query/key
    normalisation: kappa(J) is taken with the module's Q/K/V biases and, for Hugging Face modules
    whose config gives a plain rope_theta, with its RoPE (rotate_half, positions 0, 1, …; MATH.md
    §10); other RoPE variants and query/key normalisation are flagged (has_bias, rope) and the
    note says what kappa(J) ignores. `mask` ('none' or 'causal') is the mask kappa(J) uses.
    `progress` is called with the fraction of heads done. With jacobian=False the model is not
    run (`inputs` is not used) and N is 0.
    """
    sites = find_attention(model)
    if not sites:
        raise ValueError("analyze_model: the model has no attention module spectral_cond knows")
    wanted = None if layers is None else set(layers)
    # The model runs only when kappa(J) needs its activations.
    captured = _capture(model, sites, inputs) if jacobian else None
    todo = [(i, s) for i, s in enumerate(sites) if wanted is None or i in wanted]
    total = sum(s.heads for _, s in todo) or 1
    done = 0
    out = ModelAnalysis()
    for i, s in todo:
        X, base_notes = _site_X(s, captured, i, sample) if jacobian else (None, [])
        WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
        d = s.head_dim
        for h in range(s.heads):
            g, wq, wk, wv = _head_weights(s, WQ, WK, WV, h)
            biases, rope = _head_extras(s, h) if jacobian else (None, None)
            notes = list(base_notes)
            J = None
            diag = None
            if jacobian and X is not None:
                J = sc.kappa_jacobian(X, wq, wk, wv, method=method, tol=tol, scale=s.scale,
                                      mask=mask, biases=biases, rope=rope)
                if J.note:
                    notes.append(J.note)
                if biases is not None or rope is not None:
                    notes.append("kappa(J) with the module's " + " and ".join(
                        w for w, on in (("biases", biases is not None), ("RoPE", rope is not None))
                        if on) + " (MATH.md §10)")
                if diagnostics:
                    diag = sc.attention_diagnostics(X, wq, wk, wv, scale=s.scale, mask=mask,
                                                    biases=biases, rope=rope)
                    if diag.note:
                        notes.append(diag.note)
            nan = float("nan")
            out.append(HeadAnalysis(
                layer=i, name=s.name, kind=s.kind, head=h, kv_head=g,
                N=0 if X is None else X.shape[0], D=s.D, d_k=d, d_v=d,
                scale=s.scale if s.scale is not None else 1.0 / math.sqrt(d),
                kappa_WQ=_weight_kappa(wq), kappa_WK=_weight_kappa(wk),
                kappa_WV=_weight_kappa(wv),
                kappa_J=J.kappa if J else nan, kappa_plus_J=J.kappa_plus if J else nan,
                method=J.method if J else "", accuracy=J.accuracy if J else nan,
                info=J.info if J else "not_computed", has_bias=s.has_bias, rope=s.rope,
                note="; ".join(notes), jacobian=J, diagnostics=diag))
            done += 1
            if progress is not None:
                progress(done / total)
    return out


class _Budget(Exception):
    """Raised from a progress callback to stop a kappa(J) call that ran past its budget."""


class KappaMonitor:
    """A training callback that measures conditioning every `every` steps (MATH.md §4, §11, §12).

    monitor = KappaMonitor(model, every=50, log="kappa.jsonl")
    for step, (x, y) in enumerate(batches):
        ...; optimizer.step()
        monitor(step, x)        # measures at steps 0, 50, 100, ... on this batch

    At each measured step it writes one JSON line per layer (kind "layer": kappa of the layer's
    effective W_Q, W_K, W_V, i.e. with any spectral_conditioning correction) and one per
    sampled head (kind "head": kappa of the head's blocks, kappa(J) at the batch's real
    activations with method, stated accuracy and info, and the attention diagnostics with the
    bound without hypothesis). `heads` heads are sampled per layer (None: all) with a generator
    seeded by (seed, step), so every run with the same seed measures the same heads. kappa(J)
    calls share a time budget of `budget_s` seconds per measured step: a call running past it is
    cancelled and logged with info "budget", and the heads after it are logged as "skipped".
    The probe forward pass runs in eval mode without gradients and restores the global random
    state, so monitoring changes neither the model's mode nor the random numbers training draws.
    `log` may be a path ending in .jsonl/.json (JSON lines) or .csv, or None (records are
    kept in `records` either way). `overhead_s` is the time spent measuring.
    """

    def __init__(self, model: nn.Module, every: int = 100, log: Optional[str] = None,
                 heads: Optional[int] = 1, method: str = "auto", tol: float = 1e-6,
                 budget_s: float = 10.0, mask: str = "none", sample: int = 0, seed: int = 0,
                 diagnostics: bool = True, layers: Optional[Iterable[int]] = None):
        if every < 1:
            raise ValueError("KappaMonitor: every must be >= 1")
        if heads is not None and heads < 1:
            raise ValueError("KappaMonitor: heads must be >= 1 or None (all heads)")
        if not budget_s > 0:
            raise ValueError("KappaMonitor: budget_s must be > 0")
        self.model = model
        self.every = every
        self.heads = heads
        self.method = method
        self.tol = tol
        self.budget_s = budget_s
        self.mask = mask
        self.sample = sample
        self.seed = seed
        self.diagnostics = diagnostics
        self.layers = None if layers is None else set(layers)
        self.sites = find_attention(model)
        if not self.sites:
            raise ValueError("KappaMonitor: the model has no attention module spectral_cond knows")
        self.records: List[dict] = []
        self.overhead_s = 0.0
        self._log = log
        self._file = None
        self._csv = None
        if log is not None:
            if not (log.endswith(".jsonl") or log.endswith(".json") or log.endswith(".csv")):
                raise ValueError(f"KappaMonitor: log {log!r}: expected a .jsonl, .json or .csv path")
            self._file = open(log, "w", newline="")

    def __enter__(self) -> "KappaMonitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __call__(self, step: int, inputs: Any, **extra: Any) -> Optional[List[dict]]:
        """Measures when step % every == 0 (returns the new records), else does nothing and
        returns None. `extra` (e.g. loss=..., epoch=...) is copied into every record."""
        if step % self.every != 0:
            return None
        return self.measure(inputs, step=step, **extra)

    def measure(self, inputs: Any, step: int = 0, **extra: Any) -> List[dict]:
        """Measures now, whatever the step."""
        import time

        t0 = time.perf_counter()
        captured = _capture(self.model, self.sites, inputs, probe=True)
        rng = np.random.default_rng([self.seed, step])
        deadline = t0 + self.budget_s
        new: List[dict] = []
        for i, s in enumerate(self.sites):
            if self.layers is not None and i not in self.layers:
                continue
            X, notes = _site_X(s, captured, i, self.sample)
            WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
            base = dict(extra, step=step, layer=i, name=s.name)
            new.append(dict(base, kind="layer", kappa_WQ=_weight_kappa(WQ),
                            kappa_WK=_weight_kappa(WK), kappa_WV=_weight_kappa(WV),
                            N=0 if X is None else int(X.shape[0]), D=s.D, heads=s.heads))
            chosen = range(s.heads) if self.heads is None or self.heads >= s.heads else sorted(
                int(h) for h in rng.choice(s.heads, size=self.heads, replace=False))
            for h in chosen:
                new.append(self._head(base, s, X, notes, WQ, WK, WV, h, deadline))
        self.overhead_s += time.perf_counter() - t0
        self._write(new)
        self.records.extend(new)
        return new

    def _head(self, base: dict, s: AttentionSite, X: Optional[np.ndarray], notes: List[str],
              WQ, WK, WV, h: int, deadline: float) -> dict:
        import time

        g, wq, wk, wv = _head_weights(s, WQ, WK, WV, h)
        biases, rope = _head_extras(s, h)
        nan = float("nan")
        r = dict(base, kind="head", head=h, kv_head=g, kappa_WQ=_weight_kappa(wq),
                 kappa_WK=_weight_kappa(wk), kappa_WV=_weight_kappa(wv), kappa_J=nan,
                 kappa_plus_J=nan, sigma_min_J=nan, sigma_max_J=nan, method="", accuracy=nan,
                 info="not_computed", row_max_mean=nan, row_max_min=nan, entropy_mean=nan,
                 saturated_fraction=nan, ratio_QK_V=nan, collapsed=None, free_bound=nan,
                 seconds=0.0, note="; ".join(notes))
        if X is None:
            return r
        if time.perf_counter() >= deadline:
            r["info"] = "skipped"
            r["note"] = "; ".join(notes + ["the step's time budget was spent before this head"])
            return r

        def check(_fraction):
            if time.perf_counter() > deadline:
                raise _Budget()

        t = time.perf_counter()
        try:
            J = sc.kappa_jacobian(X, wq, wk, wv, method=self.method, tol=self.tol,
                                  scale=s.scale, mask=self.mask, progress=check, biases=biases,
                                  rope=rope)
        except _Budget:
            r["info"] = "budget"
            r["seconds"] = time.perf_counter() - t
            r["note"] = "; ".join(notes + [f"kappa(J) cancelled after the step's budget of "
                                           f"{self.budget_s} s"])
            return r
        r.update(kappa_J=J.kappa, kappa_plus_J=J.kappa_plus, sigma_min_J=J.sigma_min,
                 sigma_max_J=J.sigma_max, method=J.method, accuracy=J.accuracy, info=J.info)
        if J.note:
            notes = notes + [J.note]
        if self.diagnostics:
            d = sc.attention_diagnostics(X, wq, wk, wv, scale=s.scale, mask=self.mask,
                                         biases=biases, rope=rope)
            r.update(row_max_mean=d.row_max_mean, row_max_min=d.row_max_min,
                     entropy_mean=d.entropy_mean, saturated_fraction=d.saturated_fraction,
                     ratio_QK_V=d.ratio_QK_V, collapsed=d.collapsed,
                     free_bound=d.free_bound.bound if d.free_bound else nan)
            if d.note:
                notes = notes + [d.note]
        r["seconds"] = time.perf_counter() - t
        r["note"] = "; ".join(notes)
        return r

    # Columns of the CSV log: every key of a head record; layer records leave the head columns
    # empty. Extra keys (loss=..., ...) go first, in the order of the first call.
    _COLUMNS = ("step", "kind", "layer", "name", "head", "kv_head", "N", "D", "heads",
                "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_J", "kappa_plus_J", "sigma_min_J",
                "sigma_max_J", "method", "accuracy", "info", "row_max_mean", "row_max_min",
                "entropy_mean", "saturated_fraction", "ratio_QK_V", "collapsed", "free_bound",
                "seconds", "note")

    def _write(self, new: List[dict]) -> None:
        if self._file is None or not new:
            return
        import json

        if self._log.endswith(".csv"):
            import csv

            if self._csv is None:
                extra = [k for k in new[0] if k not in self._COLUMNS]
                self._csv = csv.DictWriter(self._file, fieldnames=extra + list(self._COLUMNS),
                                           extrasaction="ignore")
                self._csv.writeheader()
            for r in new:
                self._csv.writerow({k: _csv_value(v) for k, v in r.items()})
        else:
            for r in new:
                self._file.write(json.dumps({k: _json_value(v) for k, v in r.items()}) + "\n")
        self._file.flush()


def _json_value(v: Any) -> Any:
    """JSON has no inf or NaN: +inf is written as the string "inf", NaN as null."""
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
    return v


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def read_monitor_log(path: str) -> List[dict]:
    """The records of a KappaMonitor JSON-lines log, with "inf" read back as float('inf') and
    null as NaN (the inverse of the log's encoding)."""
    import json

    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            for k, v in r.items():
                if v is None and k not in ("collapsed",):
                    r[k] = float("nan")
                elif v in ("inf", "-inf"):
                    r[k] = float(v)
            out.append(r)
    return out
