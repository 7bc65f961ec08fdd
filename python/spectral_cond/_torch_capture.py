"""Attention exactly as a PyTorch module computes it (docs/python.md, "Models"; MATH.md §10).

The model runs once with hooks on each attention module. For every call they keep the module's
arguments (its input X, the mask it was given, the rotary angles it was given), its output, and
the input of its output projection (the concatenated heads). From these, `call_model` builds for
each head the library's inputs: X, the head's W_Q, W_K, W_V blocks and biases, the logit scale,
the additive mask of that sample (causal, padding, sliding window, relative position bias) and
the module's own RoPE tables. Then `verify` re-runs a float64 copy of the module on the same
arguments and compares its per-head output with the library's forward: a head whose model does
not reproduce the module's output is declined with the difference, never analysed as a different
function.
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

import spectral_cond as sc
from ._torch_sites import AttentionSite

# Below this relative difference (per head, Frobenius, over the rows that attend to some key)
# between the library's forward and a float64 re-run of the module, the library's model of the
# head is the module's. A float64 re-run is float64 throughout for sdpa (differences near 1e-16
# on every model tried), but Hugging Face's eager attention takes its softmax in float32 whatever
# the dtype (differences 1e-8 to 1e-7); every feature left out that was tried (a dropped causal
# or padding mask, RoPE, a RoPE of another rope_type, ALiBi, query normalisation, a relative
# position bias) differed by 2e-3 or more.
VERIFY_TOL_FLOAT64 = 1e-5

_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


@dataclass
class Call:
    """One call of an attention module."""

    args: tuple
    kwargs: dict
    bound: Dict[str, Any]  # the arguments by parameter name (empty when binding failed)
    output: Any = None
    context: Optional[torch.Tensor] = None  # input of the output projection (native dtype)


@dataclass
class HeadModel:
    """The library's inputs for one head of one call, and what stands in the way."""

    head: int
    kv_head: int
    X: Optional[np.ndarray]
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    scale: Optional[float]
    mask: Any  # None, "causal" or an N x N additive array
    biases: Optional[tuple]
    rope: Optional[sc.Rope]
    dead_rows: np.ndarray  # query rows that attend to no key
    refusal: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    verify_error: float = float("nan")  # relative difference to the module's own forward
    module_rows: Optional[np.ndarray] = None  # the module's own output for this head (N x d_v)
    dead_kind: str = ""  # rows attending to no key: "zero" or "equal" outputs (J singular)
    rope_check: Optional[sc.Rope] = None  # the module's own RoPE tables, for the check


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple):
        return tuple(_detach(x) for x in v)
    if isinstance(v, list):
        return [_detach(x) for x in v]
    return v


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> Dict[str, Any]:
    try:
        b = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    out = dict(b.arguments)
    for k, v in list(out.items()):
        if isinstance(v, dict) and k == "kwargs":  # **kwargs of the signature
            out.update(v)
    return out


def run_model(model: nn.Module, inputs: Any) -> None:
    if isinstance(inputs, dict):
        model(**inputs)
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    else:
        model(inputs)


def capture(model: nn.Module, sites: List[AttentionSite], wanted: Optional[set], inputs: Any,
            probe: bool = True) -> Dict[int, List[Call]]:
    """Runs `model` on `inputs` in eval mode without gradients (the global random state saved and
    restored; the model's mode restored) and returns, per site index, every call of its module.
    Only the sites in `wanted` (None: all) are hooked."""
    calls: Dict[int, List[Call]] = {}
    handles = []
    for i, s in enumerate(sites):
        if wanted is not None and i not in wanted:
            continue
        calls[i] = []

        def pre(module, args, kwargs, i=i):
            a, k = _detach(args), {n: _detach(v) for n, v in kwargs.items()}
            calls[i].append(Call(a, k, _bind(module, a, k)))

        def post(module, args, kwargs, output, i=i):
            if calls[i]:
                calls[i][-1].output = _detach(output)

        handles.append(s.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(s.module.register_forward_hook(post, with_kwargs=True))
        if s.out_proj is not None:
            def ctx(module, args, i=i):
                if calls[i] and calls[i][-1].context is None and args:
                    calls[i][-1].context = _detach(args[0])
            handles.append(getattr(s.module, s.out_proj).register_forward_pre_hook(ctx))
    was_training = model.training
    # In eval mode without gradients nn.TransformerEncoderLayer and nn.MultiheadAttention take
    # a fused "fast path" that never calls the attention module's forward (nor its hooks).
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    try:
        if fast is not None:
            mha.set_fastpath_enabled(False)
        with torch.no_grad():
            model.eval()
            if probe:
                with torch.random.fork_rng(devices=[]):
                    run_model(model, inputs)
            else:
                run_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        if fast is not None:
            mha.set_fastpath_enabled(fast)
    return calls


# ---------------------------------------------------------------------------------------------
# The inputs of one call, read the way the module reads them


def _arg(call: Call, names, default=None):
    for n in names:
        if n in call.bound:
            return call.bound[n]
        if n in call.kwargs:
            return call.kwargs[n]
    return default


def _x_of(site: AttentionSite, call: Call) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """The module's input X (batch first) and, when it is not self-attention, why."""
    if site.family == "torch":
        q = _arg(call, ("query",), call.args[0] if call.args else None)
        k = _arg(call, ("key",), call.args[1] if len(call.args) > 1 else None)
        v = _arg(call, ("value",), call.args[2] if len(call.args) > 2 else None)
        same = all(t is q or (isinstance(t, torch.Tensor) and t.shape == q.shape
                              and torch.equal(t, q)) for t in (k, v))
        if q is not None and q.dim() == 3 and not site.module.batch_first:
            q = q.transpose(0, 1)
        if not same:
            return q, "key/value inputs differ from the query (cross-attention)"
        return q, None
    x = _arg(call, ("hidden_states", "x", "query", "hidden_state"),
             call.args[0] if call.args else None)
    for n in ("key_value_states", "encoder_hidden_states", "kv", "context"):
        other = _arg(call, (n,))
        if isinstance(other, torch.Tensor) and other is not x:
            return x, f"keys and values come from another sequence ({n}: cross-attention)"
    return x, None


def _is_causal(site: AttentionSite, call: Call) -> bool:
    flag = _arg(call, ("is_causal",))
    if isinstance(flag, bool):
        return flag
    if site.family == "huggingface":
        flag = getattr(site.module, "is_causal", False)
        return flag is True
    return False


def _as_additive(m: torch.Tensor, keep_true: bool) -> np.ndarray:
    """A mask as additive float64: bool masks by `keep_true` (True keeps for PyTorch's sdpa and
    Hugging Face, True removes for nn.MultiheadAttention), float masks with every entry at or
    below half the dtype's lowest value read as -inf (Hugging Face's eager masks use that value
    for "removed")."""
    if m.dtype == torch.bool:
        keep = m if keep_true else ~m
        return np.where(keep.cpu().numpy(), 0.0, -np.inf)
    a = m.to("cpu", torch.float64).numpy().copy()
    lowest = torch.finfo(m.dtype).min if m.dtype.is_floating_point else -np.inf
    a[a <= lowest / 2] = -np.inf
    return a


def _mask_for(site: AttentionSite, call: Call, b: int, h: int, N: int,
              bias: Optional[np.ndarray]) -> Tuple[Any, List[str], Optional[str]]:
    """The additive N x N mask of sample b, head h (None, "causal" or an array), notes, and a
    refusal."""
    notes: List[str] = []
    total = None if bias is None else bias.copy()

    def add(a: np.ndarray):
        nonlocal total
        total = a if total is None else total + a

    def pick(m: torch.Tensor) -> Optional[np.ndarray]:
        """Sample b, head h of a mask of 2 to 4 dimensions, broadcast to N x N."""
        t = m
        if t.dim() == 4:
            t = t[b if t.shape[0] > 1 else 0]
            t = t[h if t.shape[0] > 1 else 0]
        elif t.dim() == 3:
            t = t[b * site.heads + h if t.shape[0] > 1 else 0]
        if t.dim() != 2 or t.shape[-1] != N or t.shape[0] not in (1, N):
            return None
        return np.broadcast_to(_as_additive(t, site.family != "torch"), (N, N)).copy()

    if site.family == "torch":
        am = _arg(call, ("attn_mask",))
        kpm = _arg(call, ("key_padding_mask",))
        if isinstance(am, torch.Tensor):
            if am.dim() == 3 and am.shape[0] == site.heads * _batch(call, site):
                am = am.reshape(-1, site.heads, N, N)
            a = pick(am)
            if a is None:
                return None, notes, f"attn_mask of shape {tuple(am.shape)} is not read here"
            add(a)
            notes.append("the module's attn_mask")
        elif _is_causal(site, call):
            add(np.triu(np.full((N, N), -np.inf), 1))
            notes.append("causal (is_causal)")
        if isinstance(kpm, torch.Tensor):
            row = kpm[b] if kpm.dim() == 2 else kpm
            add(np.broadcast_to(_as_additive(row.reshape(1, N), keep_true=False), (N, N)).copy())
            notes.append("the module's key_padding_mask")
    else:
        m = _arg(call, ("attention_mask", "attn_mask", "mask"))
        if isinstance(m, torch.Tensor):
            a = pick(m)
            if a is None:
                return None, notes, f"an attention mask of shape {tuple(m.shape)} is not read here"
            add(a)
            notes.append("the module's attention mask")
        elif m is not None and not isinstance(m, torch.Tensor):
            return None, notes, f"an attention mask of type {type(m).__name__} is not read here"
        elif _is_causal(site, call):
            add(np.triu(np.full((N, N), -np.inf), 1))
            notes.append("causal (the module's is_causal)")
        window = _arg(call, ("sliding_window",))
        if isinstance(window, int) and window > 0 and N > window and not isinstance(m, torch.Tensor):
            return None, notes, (f"a sliding window of {window} tokens passed to the attention "
                                 "kernel rather than as a mask is not read here")
    if total is None:
        return None, notes, None
    if np.all(total == 0):
        return None, notes, None
    causal = np.triu(np.full((N, N), -np.inf), 1)
    if np.array_equal(total, causal):
        return "causal", notes, None
    return total, notes, None


def _batch(call: Call, site: AttentionSite) -> int:
    x, _ = _x_of(site, call)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 3 else 1


def _rope_for(site: AttentionSite, call: Call, b: int, N: int) -> Tuple[Any, Optional[str]]:
    """The module's RoPE for sample b, as (exact, module's own) from the angles it was given (the
    first recomputed in float64 where the config allows, else the module's tables), or (None,
    None), and a refusal."""
    pe = _arg(call, ("position_embeddings",))
    if site.family == "timm":
        if _arg(call, ("rope",)) is not None:
            return None, "timm rotary embeddings (the rope argument) are not modelled"
        return None, None
    if pe is None:
        for a in ("rotary_emb", "rotary", "rope", "rotary_fn"):
            if isinstance(getattr(site.module, a, None), nn.Module):
                return None, ("the module computes rotary position embeddings itself "
                              f"({a}), which are not read here")
        return None, None
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2
            and all(isinstance(t, torch.Tensor) for t in pe)):
        return None, f"position_embeddings of type {type(pe).__name__} are not read here"
    config = getattr(site.module, "config", None)
    if _model_type(site) == "falcon" and getattr(config, "alibi", False):
        return None, None  # Falcon with ALiBi is given angles it does not apply
    cos, sin = pe
    gptj = _model_type(site) in ("gptj", "codegen")
    if gptj:  # GPT-J passes (sin, cos), each half the rotated width, for interleaved pairs
        sin, cos = cos, sin
    if cos.dim() == 3:
        cos, sin = cos[b if cos.shape[0] > 1 else 0], sin[b if sin.shape[0] > 1 else 0]
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != N:
        return None, f"rotary tables of shape {tuple(pe[0].shape)} are not read here"
    c = cos.to("cpu", torch.float64).numpy()
    s = sin.to("cpu", torch.float64).numpy()
    if gptj:
        c, s = np.repeat(c, 2, axis=1), np.repeat(s, 2, axis=1)
    r = int(c.shape[1])
    d = site.head_dim
    if r > d or r % 2:
        return None, f"rotary tables of width {r} do not fit heads of {d}"
    half = r // 2
    if np.array_equal(c[:, :half], c[:, half:]) and np.array_equal(s[:, :half], s[:, half:]):
        pairing = "rotate_half"
    elif np.array_equal(c[:, 0::2], c[:, 1::2]) and np.array_equal(s[:, 0::2], s[:, 1::2]):
        pairing = "interleaved"
    else:
        return None, "the rotary tables pair columns in a way not known here"
    module_rope = sc.Rope(pairing, dims=0 if r == d else r, cos=np.ascontiguousarray(c),
                          sin=np.ascontiguousarray(s))
    exact = _rope_float64(site, call, b, N, r, pairing, c, s)
    if exact is None:
        return (module_rope, module_rope), None
    return (sc.Rope(pairing, dims=module_rope.dims, cos=exact[0], sin=exact[1]), module_rope), None


def _model_type(site: AttentionSite) -> str:
    return str(getattr(getattr(site.module, "config", None), "model_type", "") or "")


def rope_parameters(site: AttentionSite) -> Optional[dict]:
    """The module's RoPE parameters from its config: transformers 5's rope_parameters (one dict,
    or one per layer type, picked by the module's layer_idx), else the older rope_theta /
    rope_scaling keys. None when the config says nothing."""
    config = getattr(site.module, "config", None)
    if config is None:
        return None
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        types = getattr(config, "layer_types", None)
        idx = getattr(site.module, "layer_idx", None)
        rp = rp.get(types[idx]) if isinstance(types, (list, tuple)) and isinstance(idx, int) \
            and 0 <= idx < len(types) else None
    if isinstance(rp, dict) and "rope_theta" in rp:
        return dict(rp)
    theta = getattr(config, "rope_theta", None)
    if isinstance(theta, (int, float)):
        out = {"rope_theta": float(theta), "rope_type": "default"}
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, dict):
            out.update(scaling)
            out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        return out
    if _model_type(site) in ("gptj", "codegen"):
        return {"rope_theta": 10000.0, "rope_type": "default"}
    return None


def _rope_float64(site: AttentionSite, call: Call, b: int, N: int, r: int, pairing: str,
                  c32: np.ndarray, s32: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """The rotary tables recomputed in float64 from the config (rope_type default or linear:
    angles position x theta^(-2j/r) / factor), when they equal the module's own tables to their
    rounding; else None (the module's tables are used as they are). The module computes its
    angles in float32, whose rounding grows with the position; κ(J) is that of exact angles."""
    rp = rope_parameters(site)
    if rp is None or rp.get("rope_type", "default") not in ("default", "linear"):
        return None
    factor = float(rp.get("factor", 1.0)) if rp.get("rope_type") == "linear" else 1.0
    theta = float(rp["rope_theta"])
    pos = _arg(call, ("position_ids",))
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and pos.shape[-1] == N:
        p = pos[b if pos.shape[0] > 1 else 0].to("cpu", torch.float64).numpy()
    else:
        p = np.arange(N, dtype=np.float64)
    inv = theta ** (-np.arange(0, r, 2, dtype=np.float64) / r) / factor
    ang = p[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], 1) if pairing == "rotate_half" else np.repeat(ang, 2, 1)
    c64, s64 = np.cos(ang), np.sin(ang)
    # float32 rounding of the angle (about eps |angle|, twice) and of cos and sin themselves.
    tol = 8 * float(np.finfo(np.float32).eps) * (1 + float(np.max(np.abs(ang), initial=0)))
    if np.max(np.abs(c64 - c32), initial=0) > tol or np.max(np.abs(s64 - s32), initial=0) > tol:
        return None
    return c64, s64


def _logit_bias(site: AttentionSite, call: Call, b: int, h: int, N: int) -> Optional[np.ndarray]:
    """A per-head additive logit bias the module adds besides its mask (T5's relative position
    bias: given as position_bias, or computed by the module and returned second)."""
    alibi = _arg(call, ("alibi",))
    if isinstance(alibi, torch.Tensor):  # Bloom: (batch heads) x 1 x N, added to every row
        t = alibi.reshape(-1, site.heads, alibi.shape[-2], alibi.shape[-1])
        t = t[b if t.shape[0] > 1 else 0][h]
        return np.broadcast_to(t.to("cpu", torch.float64).numpy(), (N, N)).copy()
    pb = _arg(call, ("position_bias",))
    if pb is None and getattr(site.module, "has_relative_attention_bias", False):
        out = call.output
        if isinstance(out, (tuple, list)) and len(out) > 1 and isinstance(out[1], torch.Tensor):
            pb = out[1]
    if not isinstance(pb, torch.Tensor) or pb.dim() != 4:
        return None
    t = pb[b if pb.shape[0] > 1 else 0][h if pb.shape[1] > 1 else 0]
    if tuple(t.shape) != (N, N):
        return None
    return t.to("cpu", torch.float64).numpy().copy()


def call_model(site: AttentionSite, call: Call, sample: int, WQ: np.ndarray, WK: np.ndarray,
               WV: np.ndarray) -> Tuple[List[HeadModel], List[str]]:
    """The library's inputs for every head of `call`, sample `sample`, and the call's notes."""
    d = site.head_dim
    group = site.heads // site.kv_heads
    x, cross = _x_of(site, call)
    notes: List[str] = []
    X = None
    if not isinstance(x, torch.Tensor):
        cross = cross or "the module's input X was not found among its arguments"
    else:
        if x.dim() == 3:
            if not 0 <= sample < x.shape[0]:
                raise ValueError(f"sample {sample} is outside the batch of {x.shape[0]}")
            x = x[sample]
        X = x.to("cpu", torch.float64).numpy()
    bs = (site.q.b(), site.k.b(), site.v.b())
    heads: List[HeadModel] = []
    N = 0 if X is None else X.shape[0]
    ropes, rope_refusal = (None, None) if X is None else _rope_for(site, call, sample, N)
    rope, rope_check = ropes if ropes else (None, None)
    if rope is not None and rope is not rope_check:
        notes.append("RoPE angles recomputed in float64 from the config (the module's float32 "
                     "tables agree to their rounding)")
    elif rope is not None:
        notes.append("RoPE from the module's own angle tables (its rope_type is not recomputed "
                     "here)")
    for h in range(site.heads):
        g = h // group
        hm = HeadModel(h, g, X, WQ[:, h * d:(h + 1) * d], WK[:, g * d:(g + 1) * d],
                       WV[:, g * d:(g + 1) * d], site.scale, None, None, rope,
                       np.zeros(0, dtype=np.int64))
        hm.rope_check = rope_check
        if any(b is not None for b in bs):
            hm.biases = tuple(None if b is None else b[j * d:(j + 1) * d]
                              for b, j in zip(bs, (h, g, g)))
        hm.refusal = site.refusal or cross or rope_refusal
        if X is not None and hm.refusal is None:
            bias = _logit_bias(site, call, sample, h, N)
            mask, mnotes, why = _mask_for(site, call, sample, h, N, bias)
            if why:
                hm.refusal = why
            else:
                hm.mask = mask
                if isinstance(mask, np.ndarray):
                    hm.dead_rows = np.flatnonzero(np.all(np.isneginf(mask), axis=1))
                if h == 0:
                    notes.extend(mnotes)
                    if bias is not None:
                        notes.append("the module's relative position bias as an additive mask")
        heads.append(hm)
    return heads, notes


# ---------------------------------------------------------------------------------------------
# Checking the model of a call against the module's own forward


def _to64(v):
    if isinstance(v, torch.Tensor):
        return v.to(torch.float64) if v.dtype.is_floating_point else v
    if isinstance(v, tuple):
        return tuple(_to64(x) for x in v)
    if isinstance(v, list):
        return [_to64(x) for x in v]
    if type(v).__name__.endswith("Cache"):
        return None
    return v


def rerun64(site: AttentionSite, call: Call, copies: Dict[int, nn.Module]) -> Tuple[Any, Any]:
    """A float64 copy of the module run on the call's arguments in float64: (output, context)."""
    key = id(site.module)
    if key not in copies:
        copies[key] = copy.deepcopy(site.module).to(torch.float64).eval()
    m = copies[key]
    args = tuple(_to64(a) for a in call.args)
    kwargs = {k: (None if k in _CACHE_KWARGS else _to64(v)) for k, v in call.kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    got: Dict[str, Any] = {}
    handle = None
    if site.out_proj is not None:
        handle = getattr(m, site.out_proj).register_forward_pre_hook(
            lambda mod, a: got.setdefault("ctx", a[0].detach()))
    try:
        with torch.no_grad():
            out = m(*args, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    return _detach(out), got.get("ctx")


def _ours(hm: HeadModel) -> np.ndarray:
    """The library's forward for the head, with rows that attend to no key set to 0."""
    mask = hm.mask
    if isinstance(mask, np.ndarray) and hm.dead_rows.size:
        mask = mask.copy()
        mask[hm.dead_rows] = 0.0
    A = sc.attention(hm.X, hm.wq, hm.wk, hm.wv, scale=hm.scale, mask=mask, biases=hm.biases,
                     rope=hm.rope_check)
    return np.asarray(A, dtype=np.float64)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def verify(site: AttentionSite, call: Call, sample: int, heads: List[HeadModel],
           copies: Dict[int, nn.Module]) -> Optional[str]:
    """Compares each head's library forward with the module's own output and declines the heads
    that differ (HeadModel.refusal, verify_error). Returns a note for the call (how it was
    checked), or None."""
    todo = [hm for hm in heads if hm.refusal is None and hm.X is not None]
    if not todo:
        return None
    N, d = todo[0].X.shape[0], site.head_dim
    exact = True
    try:
        out, ctx = rerun64(site, call, copies)
    except Exception as e:  # any failure of the float64 copy: fall back to the native output
        out, ctx, exact = call.output, call.context, False
        reason = f"{type(e).__name__}: {e}"
    mine = {hm.head: _ours(hm) for hm in todo}
    ref = None
    per_head = True
    if ctx is not None:
        ref = ctx
    else:
        t = _first_tensor(out)
        if t is not None and site.family == "torch" and t.dim() == 3 and not site.module.batch_first:
            t = t.transpose(0, 1)
        ref = t
        if site.family == "torch" or site.out_proj is not None:
            per_head = False
    if ref is None:
        for hm in todo:
            hm.refusal = ("the module's output could not be read to check spectral_cond's model "
                          "of it")
        return None
    ref = ref[sample] if ref.dim() == 3 else ref
    ref = ref.to("cpu", torch.float64).numpy()
    if exact:
        tol = VERIFY_TOL_FLOAT64
        how = "checked against a float64 re-run of the module"
    else:
        t = ctx if ctx is not None else _first_tensor(out)
        eps = float(torch.finfo(t.dtype).eps) if t.dtype.is_floating_point else 1e-3
        zmax = max(float(np.max(np.abs(_logits(hm)))) for hm in todo)
        tol = min(0.3, 64 * eps * (1 + zmax))
        how = (f"checked against the module's own output in its dtype to {tol:.1e} (a float64 "
               f"re-run failed: {reason})")
    live = np.ones(N, dtype=bool)
    for hm in todo:
        live[hm.dead_rows] = False
    if per_head:
        if ref.shape != (N, site.heads * d):
            for hm in todo:
                hm.refusal = (f"the module's output has shape {ref.shape}, not N x heads d = "
                              f"{N} x {site.heads * d}: its model could not be checked")
            return how
        for hm in todo:
            r = ref[:, hm.head * d:(hm.head + 1) * d]
            _judge(hm, r, mine[hm.head], live, tol, how)
    else:
        ctx_all = np.zeros((N, site.heads * d))
        for hm in todo:
            ctx_all[:, hm.head * d:(hm.head + 1) * d] = mine[hm.head]
        W, bvec = _out_projection(site)
        if W is None or ref.shape != (N, W.shape[0]) or len(todo) != site.heads:
            for hm in todo:
                hm.refusal = "the module's output could not be compared with spectral_cond's model"
            return how
        full = ctx_all @ W.T + (0 if bvec is None else bvec)
        err = _rel(ref[live], full[live])
        for hm in todo:
            hm.verify_error = err
            if not err <= tol:
                hm.refusal = (f"spectral_cond's model of this attention differs from the module's "
                              f"own forward by {err:.2e} (relative; {how})")
    for hm in todo:
        if hm.refusal is None and hm.dead_rows.size:
            _dead_rows_kind(hm, ref if per_head else None, d)
    return how


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    den = max(np.linalg.norm(b), np.finfo(np.float64).tiny)
    return float(np.linalg.norm(a - b) / den)


def _judge(hm: HeadModel, ref: np.ndarray, mine: np.ndarray, live: np.ndarray, tol: float,
           how: str) -> None:
    err = _rel(ref[live], mine[live]) if live.any() else 0.0
    hm.verify_error = err
    hm.module_rows = ref
    if not err <= tol:
        hm.refusal = (f"spectral_cond's model of this head differs from the module's own forward "
                      f"by {err:.2e} (relative; {how}); kappa(J) of a different function is not "
                      "reported")


def _dead_rows_kind(hm: HeadModel, ref: Optional[np.ndarray], d: int) -> None:
    """Rows that attend to no key (a query masked entirely, e.g. left padding): what the module
    outputs there decides J's rows. Zeros (PyTorch's sdpa) or one shared row in two or more places
    make J singular exactly; otherwise the head is declined."""
    rows = hm.module_rows
    if rows is None:
        hm.refusal = ("query rows " + _rows(hm.dead_rows) + " attend to no key and the module's "
                      "output there could not be read")
        return
    r = rows[hm.dead_rows]
    if np.all(r == 0):
        hm.dead_kind = "zero"
    elif hm.dead_rows.size >= 2 and np.all(r == r[0]):
        hm.dead_kind = "equal"
    else:
        hm.refusal = ("query rows " + _rows(hm.dead_rows) + " attend to no key and the module's "
                      "output there is neither zero nor shared: not modelled")


def _rows(rows: np.ndarray) -> str:
    r = [int(i) for i in rows]
    return ", ".join(map(str, r[:6])) + (", …" if len(r) > 6 else "")


def _logits(hm: HeadModel) -> np.ndarray:
    Q = hm.X @ hm.wq + (0 if hm.biases is None or hm.biases[0] is None else hm.biases[0])
    K = hm.X @ hm.wk + (0 if hm.biases is None or hm.biases[1] is None else hm.biases[1])
    c = hm.scale if hm.scale is not None else 1 / math.sqrt(hm.wq.shape[1])
    return c * Q @ K.T


def _out_projection(site: AttentionSite):
    m = site.module
    if site.family == "torch":
        W = m.out_proj.weight.detach().to("cpu", torch.float64).numpy()
        b = m.out_proj.bias
        return W, None if b is None else b.detach().to("cpu", torch.float64).numpy()
    return None, None
