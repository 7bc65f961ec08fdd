"""Where the attention modules of a PyTorch model keep W_Q, W_K and W_V (docs/python.md, "Models").

A site is one attention module with its three projections. Each projection names the parameter
tensor that holds it and which of that tensor's output features it takes, in the library's column
order (head h owns columns [h d, (h + 1) d), MATH.md §8):

- nn.Linear-like weights are out x in, so W = weight[features].T (D x heads d);
- Conv1D-like weights (GPT-2) are in x out, so W = weight[:, features].

What a site cannot be modelled with (cross-attention, query/key normalisation, logit soft-capping,
ALiBi, a fused layout not known here) is said in `refusal`; the analysis then declines its heads
with that reason rather than compute κ(J) of a different function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

# Names of the output projection a module applies to its concatenated heads (the analysis reads
# that projection's input to check its model of the module against the module's own forward).
OUT_PROJ_NAMES = ("o_proj", "out_proj", "c_proj", "proj", "dense", "o", "out_lin", "wo", "to_out")


def _is_linear(m) -> bool:
    """nn.Linear or a subclass (out x in weight)."""
    return isinstance(m, nn.Linear)


def _is_conv1d(m) -> bool:
    """Hugging Face's Conv1D (GPT-2): an in x out weight with nf / nx attributes."""
    w = getattr(m, "weight", None)
    return (isinstance(m, nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(getattr(m, "nf", None), int) and isinstance(getattr(m, "nx", None), int)
            and tuple(w.shape) == (m.nx, m.nf))


def _in_out(m) -> Tuple[int, int]:
    w = m.weight
    return (w.shape[1], w.shape[0]) if _is_linear(m) else (w.shape[0], w.shape[1])


@dataclass
class Projection:
    """One of W_Q, W_K, W_V: output features `features` of `owner.<param>` (see the module
    docstring for the two storage orders), `heads` heads of them, and the owner's bias."""

    owner: nn.Module
    param: str
    features: np.ndarray
    heads: int
    transposed: bool = True  # True: out x in (nn.Linear); False: in x out (Conv1D)
    bias_param: Optional[str] = None
    bias_features: Optional[np.ndarray] = None  # entries of the bias; None: `features`

    def __post_init__(self):
        self.features = np.asarray(self.features, dtype=np.int64)
        if self.bias_features is not None:
            self.bias_features = np.asarray(self.bias_features, dtype=np.int64)

    @property
    def width(self) -> int:
        return int(self.features.size)

    def tensor(self) -> torch.Tensor:
        return getattr(self.owner, self.param)

    def W(self, tensor: Optional[torch.Tensor] = None) -> np.ndarray:
        """The library's W (D x heads d), float64, from the parameter (or from `tensor`, a tensor
        of its shape: a parametrized parameter's original)."""
        t = (self.tensor() if tensor is None else tensor).detach()
        idx = torch.as_tensor(self.features, device=t.device)
        sel = t.index_select(0 if self.transposed else 1, idx)
        sel = sel.to("cpu", torch.float64).numpy()
        # Fortran order: every head's block of columns is then contiguous too.
        return np.asfortranarray(sel.T if self.transposed else sel)

    def b(self) -> Optional[np.ndarray]:
        """The projection's bias (float64 vector of `width` entries), or None."""
        if self.bias_param is None:
            return None
        t = getattr(self.owner, self.bias_param, None)
        if t is None:
            return None
        idx = self.features if self.bias_features is None else self.bias_features
        return t.detach().to("cpu", torch.float64).numpy()[idx]

    def place(self, full: torch.Tensor, C: np.ndarray) -> None:
        """Writes a correction C (D x width, the library's layout) into `full`, a tensor of the
        parameter's shape, at this projection's features."""
        idx = torch.as_tensor(self.features)
        src = torch.from_numpy(np.ascontiguousarray(C.T if self.transposed else C))
        full.index_copy_(0 if self.transposed else 1, idx, src.to(full.dtype))


@dataclass
class AttentionSite:
    """One attention module of a model and where its projections live."""

    name: str
    module: nn.Module
    kind: str  # "nn.MultiheadAttention", "timm", "huggingface", "huggingface-fused"
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
    family: str = "huggingface"  # how its masks read: "huggingface", "timm", "torch"
    refusal: Optional[str] = None  # why κ(J) of its heads cannot be computed, or None
    out_proj: Optional[str] = None  # the child applied to the concatenated heads, if any
    features: List[str] = field(default_factory=list)  # modelled extras, for the docs table


def _first_int(module: nn.Module, names: Sequence[str]) -> Optional[int]:
    config = getattr(module, "config", None)
    for src in (module, config):
        for n in names:
            v = getattr(src, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _float_attr(module: nn.Module, names: Sequence[str]) -> Optional[float]:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return float(v)
    return None


def _non_identity(module: nn.Module, names: Sequence[str]) -> Optional[str]:
    for a in names:
        m = getattr(module, a, None)
        if isinstance(m, nn.Module) and not isinstance(m, nn.Identity):
            return a
    return None


def _refusals(name: str, m: nn.Module) -> List[str]:
    """What the module does that spectral_cond's model of attention (MATH.md §1, §10) leaves
    out, found from its attributes and config."""
    out = []
    norm = _non_identity(m, ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm",
                             "key_layernorm"))
    if norm:
        out.append(f"the module normalises its queries/keys ({norm}), which is not modelled")
    config = getattr(m, "config", None)
    cap = getattr(config, "attn_logit_softcapping", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0:
        out.append(f"logit soft-capping (attn_logit_softcapping = {cap}) is not modelled")
    if isinstance(getattr(m, "relative_position_bias_table", None), torch.Tensor):
        out.append("a learned relative position bias (relative_position_bias_table) added inside "
                   "the module is not modelled")
    if getattr(m, "is_cross_attention", False) is True:
        out.append("cross-attention (keys and values from another sequence) is not "
                   "self-attention; kappa(J) is defined here for self-attention")
    pet = getattr(config, "position_embedding_type", None)
    if isinstance(pet, str) and pet.startswith("relative"):
        out.append(f"relative position embeddings ({pet}) are not modelled")
    if getattr(m, "gate", None) is not None and isinstance(getattr(m, "gate"), nn.Module):
        out.append("a gate on the attention output is not modelled")
    if _non_identity(m, ("norm",)) and hasattr(m, "qkv"):
        out.append("a normalisation of the attention output (scale_norm) is not modelled")
    return out


def _site_mha(name: str, m: nn.MultiheadAttention) -> AttentionSite:
    D, H = m.embed_dim, m.num_heads
    d = D // H
    r = np.arange(D)
    if m._qkv_same_embed_dim:
        q = Projection(m, "in_proj_weight", r, H, True, "in_proj_bias")
        k = Projection(m, "in_proj_weight", r + D, H, True, "in_proj_bias")
        v = Projection(m, "in_proj_weight", r + 2 * D, H, True, "in_proj_bias")
    else:
        # Separate weights; in_proj_bias still holds the three biases in a row.
        q = Projection(m, "q_proj_weight", r, H, True, "in_proj_bias", r)
        k = Projection(m, "k_proj_weight", r, H, True, "in_proj_bias", r + D)
        v = Projection(m, "v_proj_weight", r, H, True, "in_proj_bias", r + 2 * D)
    notes, refusal = [], None
    if not m._qkv_same_embed_dim:
        refusal = "separate kdim/vdim: key and value inputs differ from the query's"
    if m.bias_k is not None:
        refusal = "add_bias_kv appends a learned key/value token, which is not modelled"
    if getattr(m, "add_zero_attn", False):
        refusal = "add_zero_attn appends a zero key/value token, which is not modelled"
    has_bias = m.in_proj_bias is not None
    return AttentionSite(name, m, "nn.MultiheadAttention", D, H, H, d, q, k, v, None, has_bias,
                         False, notes, family="torch", refusal=refusal, out_proj=None)


def _site_timm(name: str, m: nn.Module, qkv: nn.Linear) -> Optional[AttentionSite]:
    H = _first_int(m, ("num_heads", "num_attention_heads", "n_heads"))
    if H is None or qkv.out_features % 3 != 0:
        return None
    D = qkv.in_features
    hd3 = qkv.out_features // 3
    d = _first_int(m, ("head_dim",)) or hd3 // H
    if d * H != hd3:
        return None
    r = np.arange(hd3)
    q = Projection(qkv, "weight", r, H, True, "bias")
    k = Projection(qkv, "weight", r + hd3, H, True, "bias")
    v = Projection(qkv, "weight", r + 2 * hd3, H, True, "bias")
    refusals = _refusals(name, m)
    return AttentionSite(name, m, "timm", D, H, H, d, q, k, v, _float_attr(m, ("scale", "scaling")),
                         qkv.bias is not None, False, [], family="timm",
                         refusal="; ".join(refusals) or None, out_proj=_out_proj(m))


def _out_proj(m: nn.Module) -> Optional[str]:
    for n in OUT_PROJ_NAMES:
        c = getattr(m, n, None)
        if isinstance(c, nn.Module) and (_is_linear(c) or _is_conv1d(c)):
            return n
    return None


def _heads_and_dim(name: str, m: nn.Module, width: int) -> Tuple[int, int]:
    H = _first_int(m, ("num_attention_heads", "num_heads", "n_heads", "n_head"))
    if H is None:
        raise ValueError(
            f"spectral_cond.torch: {name} has query/key/value projections but no head count "
            "(num_attention_heads, num_heads or config.num_attention_heads)")
    d = _first_int(m, ("attention_head_size", "head_dim", "head_size", "key_value_proj_dim"))
    d = d or width // H
    if d * H != width:
        raise ValueError(f"spectral_cond.torch: {name}: the query projection has {width} outputs, "
                         f"not {H} heads x {d}")
    return H, d


def _hf_site(name: str, m: nn.Module, kind: str, q: Projection, k: Projection, v: Projection,
             D: int, H: int, d: int, bias: bool) -> AttentionSite:
    if k.width % d or k.width != v.width or (H * d) % k.width:
        raise ValueError(f"spectral_cond.torch: {name}: key/value projections of {k.width} and "
                         f"{v.width} outputs do not make whole heads of {d}")
    KV = k.width // d
    q.heads, k.heads, v.heads = H, KV, KV
    refusals = _refusals(name, m)
    return AttentionSite(name, m, kind, D, H, KV, d, q, k, v, _float_attr(m, ("scaling",)), bias,
                         False, [], family="huggingface", refusal="; ".join(refusals) or None,
                         out_proj=_out_proj(m))


_SEPARATE = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q_lin", "k_lin", "v_lin"),
             ("q", "k", "v"), ("to_q", "to_k", "to_v"))


def _site_separate(name: str, m: nn.Module) -> Optional[AttentionSite]:
    for names in _SEPARATE:
        mods = [getattr(m, n, None) for n in names]
        if not all(isinstance(x, nn.Module) and (_is_linear(x) or _is_conv1d(x)) for x in mods):
            continue
        lq, lk, lv = mods
        D = _in_out(lq)[0]
        if any(_in_out(x)[0] != D for x in (lk, lv)):
            continue  # keys/values from another width: cross-attention by construction
        H, d = _heads_and_dim(name, m, _in_out(lq)[1])
        projs = [Projection(x, "weight", np.arange(_in_out(x)[1]), H, _is_linear(x), "bias")
                 for x in mods]
        bias = any(getattr(x, "bias", None) is not None for x in mods)
        return _hf_site(name, m, "huggingface", *projs, D, H, d, bias)
    return None


def _site_fused(name: str, m: nn.Module) -> Optional[AttentionSite]:
    """Fused Q/K/V tensors of Hugging Face models: GPT-2's c_attn (Conv1D, columns Q, K, V),
    GPT-NeoX's query_key_value (per head [q, k, v]), Phi-3's qkv_proj ([Q | K | V] with fewer
    K/V heads)."""
    c = getattr(m, "c_attn", None)
    if c is not None and (_is_conv1d(c) or _is_linear(c)) and getattr(m, "q_attn", None) is None:
        D, out = _in_out(c)
        if out % 3:
            return None
        H, d = _heads_and_dim(name, m, out // 3)
        r = np.arange(out // 3)
        projs = [Projection(c, "weight", r + j * (out // 3), H, _is_linear(c), "bias")
                 for j in range(3)]
        return _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
    c = getattr(m, "qkv_proj", None)
    if isinstance(c, nn.Linear):
        D, out = c.in_features, c.out_features
        H = _first_int(m, ("num_attention_heads", "num_heads"))
        if H is None:
            return None
        d = _first_int(m, ("head_dim",)) or D // H
        KV = _first_int(m, ("num_key_value_heads",)) or H
        if out != (H + 2 * KV) * d:
            return None
        nq, nk = H * d, KV * d
        projs = [Projection(c, "weight", np.arange(nq), H, True, "bias"),
                 Projection(c, "weight", nq + np.arange(nk), KV, True, "bias"),
                 Projection(c, "weight", nq + nk + np.arange(nk), KV, True, "bias")]
        return _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
    c = getattr(m, "query_key_value", None)
    if isinstance(c, nn.Linear):
        D, out = c.in_features, c.out_features
        model_type = getattr(getattr(m, "config", None), "model_type", "")
        H = _first_int(m, ("num_attention_heads", "num_heads", "n_head"))
        if H is None:
            return None
        config = getattr(m, "config", None)
        if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
            # Per key/value group g: its H/KV query heads, then its key, then its value.
            KV = getattr(config, "num_kv_heads", None) or H
            d = D // H
            per = H // KV + 2
            rows = lambda j0, n: ((per * d * np.arange(KV))[:, None]
                                  + (j0 * d + np.arange(n * d))[None, :]).reshape(-1)
            projs = [Projection(c, "weight", rows(0, H // KV), H, True, "bias"),
                     Projection(c, "weight", rows(H // KV, 1), KV, True, "bias"),
                     Projection(c, "weight", rows(H // KV + 1, 1), KV, True, "bias")]
            return _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
        if model_type == "falcon" and getattr(config, "multi_query", False):
            d = D // H
            projs = [Projection(c, "weight", np.arange(H * d), H, True, "bias"),
                     Projection(c, "weight", H * d + np.arange(d), 1, True, "bias"),
                     Projection(c, "weight", (H + 1) * d + np.arange(d), 1, True, "bias")]
            return _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
        if out % 3:
            return None
        H, d = _heads_and_dim(name, m, out // 3)
        if model_type in ("gpt_neox", "bloom", "falcon") or type(m).__name__.startswith("Bloom"):
            # Per head h: rows [3 h d, 3 h d + d) are q, the next d k, the next d v.
            base = (3 * d * np.arange(H))[:, None] + np.arange(d)[None, :]
            projs = [Projection(c, "weight", (base + j * d).reshape(-1), H, True, "bias")
                     for j in range(3)]
            return _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
        r = np.arange(out // 3)
        projs = [Projection(c, "weight", r + j * (out // 3), H, True, "bias") for j in range(3)]
        s = _hf_site(name, m, "huggingface-fused", *projs, D, H, d, c.bias is not None)
        s.refusal = "; ".join(filter(None, [s.refusal, (
            f"the layout of the fused query_key_value weight of {type(m).__name__} "
            f"(model_type {model_type or 'unknown'}) is not known here")]))
        return s
    return None


def site_of(name: str, m: nn.Module) -> Optional[AttentionSite]:
    """The attention site of module `m`, or None when it is not an attention module known here."""
    if isinstance(m, nn.MultiheadAttention):
        return _site_mha(name, m)
    qkv = getattr(m, "qkv", None)
    if isinstance(qkv, nn.Linear):
        return _site_timm(name, m, qkv)
    s = _site_separate(name, m)
    if s is None:
        s = _site_fused(name, m)
    return s


def find_attention(model: nn.Module) -> List[AttentionSite]:
    """Every attention module of `model` that spectral_cond knows, in module order."""
    sites = []
    for name, m in model.named_modules():
        s = site_of(name, m)
        if s is not None:
            sites.append(s)
    return sites
