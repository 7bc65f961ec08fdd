"""advise(model, inputs): the λ advisor (MATH.md §17) on a live model at its real activations.

Each attention module is found and captured exactly as analyze_model does (its masks, RoPE,
biases, scale, grouped-query heads; each head checked against a float64 re-run of the module),
and a sample of its heads is handed to the library's advise_head on one grid of λ and
placements; the recommendation over them is the grid point admissible in every sampled head
with the least median κ(J).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
from torch import nn

import spectral_cond as sc
from ._advice import DEFAULT_LAMBDAS, Advice, HeadAdvice, check_grid, head_advice
from ._torch_analysis import check_arguments, head_models, selected_sites
from ._torch_capture import capture
from ._torch_sites import AttentionSite


def is_packed(s: AttentionSite) -> bool:
    """Whether Q, K and V live in one parameter (timm's qkv, in_proj_weight, GPT-2's c_attn,
    GPT-NeoX's query_key_value): the layouts a 'packed' placement applies to."""
    return s.q.owner is s.k.owner is s.v.owner and s.q.param == s.k.param == s.v.param


def packed_columns(s: AttentionSite, head: int) -> List[int]:
    """The columns of head `head`'s Q, K, V slices within the packed weight (its output
    features), which need not be in [Q | K | V] order; each slice must be contiguous there."""
    d = s.head_dim
    group = s.heads // s.kv_heads
    out = []
    for p, h in ((s.q, head), (s.k, head // group), (s.v, head // group)):
        f = p.features[h * d:(h + 1) * d]
        if f.size == 0 or not np.array_equal(f, np.arange(f[0], f[0] + f.size)):
            raise ValueError(f"advise: {s.name}: head {head}'s features in the packed weight are "
                             "not contiguous, so the packed identity is not a shifted one")
        out.append(int(f[0]))
    return out


def _sample_heads(s: AttentionSite, heads: Union[str, int, Iterable[int]], rng: random.Random):
    if heads == "all":
        return list(range(s.heads))
    if isinstance(heads, int) and not isinstance(heads, bool):
        if heads < 1:
            raise ValueError(f"advise: heads must be 'all', an int >= 1 or a list of head "
                             f"indices (got {heads!r})")
        if heads >= s.heads:
            return list(range(s.heads))
        return sorted(rng.sample(range(s.heads), heads))
    chosen = sorted(set(int(h) for h in heads))
    bad = [h for h in chosen if not 0 <= h < s.heads]
    if bad:
        raise ValueError(f"advise: heads {bad} do not exist in {s.name} ({s.heads} heads)")
    return chosen


def advise(model: nn.Module, inputs: Any, lambdas: Sequence[float] = DEFAULT_LAMBDAS,
           placements: Optional[Sequence[str]] = None, heads: Union[str, int, Iterable[int]] = 2,
           layers: Optional[Iterable[int]] = None, sample: int = 0, seed: int = 0,
           max_saturated_fraction: float = 0.01, min_qk_ratio: float = 0.1,
           method: str = "auto", tol: float = 1e-6, mask: str = "auto", check: bool = True,
           memory_budget: int = 0,
           progress: Optional[Callable[[float], Any]] = None) -> Advice:
    """Which λ and placement of λ I to use on `model` (MATH.md §17), at its activations on
    `inputs` (a tensor, a tuple of positional arguments or a dict of keyword arguments; sample
    `sample` of the batch).

    lambdas: the grid (finite, >= 0). placements: any of 'fused', 'per_head', 'packed' and the
    subsets such as 'fused:qk', 'per_head:v' (default: fused and per_head, and packed when every
    attention module of the model keeps Q, K and V in one parameter; 'packed' on a model with
    separate Q/K/V weights is an error). heads: per layer, 'all', a number sampled at random
    (with `seed`; the default 2), or a list of head indices; layers: the attention layers
    (default all). Each head gets κ(J) (by `method`, with its stated accuracy), κ₊(J), the bound
    without hypothesis and the attention diagnostics at every grid point; a point is admissible
    while its saturated fraction is at most max_saturated_fraction and ||J_QK||/||J_V|| at
    least min_qk_ratio times its value at λ = 0. The result (a list of HeadAdvice) has `best`,
    the point admissible in every sampled head with the least median κ(J) (or none, with the
    reason), `sampling`, `to_pandas()`; spectral_conditioning(model, advice=result) applies it.
    """
    fn = "advise"
    check_arguments(fn, method, tol, mask, sample)
    lams, _ = check_grid(fn, lambdas, ["fused"])
    sites, wanted = selected_sites(fn, model, layers)
    todo = [(i, s) for i, s in enumerate(sites) if wanted is None or i in wanted]
    all_packed = all(is_packed(s) for _, s in todo)
    if placements is None:
        placements = ["fused", "per_head"] + (["packed"] if all_packed else [])
    _, pls = check_grid(fn, lams, placements)
    try:
        pls = [sc._core.placement_name(p) for p in pls]
    except ValueError as e:
        raise ValueError(f"{fn}: {e}") from None
    if any(p == "packed" for p in pls):
        separate = [s.name for _, s in todo if not is_packed(s)]
        if separate:
            raise ValueError(f"{fn}: placements: 'packed' needs Q, K and V in one parameter, "
                             f"but {separate[0]} has separate query/key/value weights")
    rng = random.Random(seed)
    chosen = {i: _sample_heads(s, heads, rng) for i, s in todo}
    captured = capture(model, sites, set(i for i, _ in todo), inputs)
    total = sum(len(h) for h in chosen.values()) or 1
    done = 0
    out: List[HeadAdvice] = []
    skipped: List[str] = []
    copies: Dict[int, nn.Module] = {}
    for i, s in todo:
        calls = captured.get(i, [])
        if s.refusal:
            skipped.append(f"layer {i} ({s.name}): {s.refusal}")
            continue
        if not calls:
            skipped.append(f"layer {i} ({s.name}): the module did not run on these inputs")
            continue
        WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
        hms, notes = head_models(s, calls[0], sample, mask, check, copies, WQ, WK, WV)
        for hm in hms:
            if hm.head not in chosen[i]:
                continue
            where = f"layer {i} ({s.name}), head {hm.head}"
            if hm.refusal or hm.X is None or hm.dead_kind:
                why = hm.refusal or ("rows that attend to no key (kappa(J) = +inf exactly)"
                                     if hm.dead_kind else "no input captured")
                skipped.append(f"{where}: {why}")
                continue
            base = done

            def head_progress(f, base=base):
                if progress is not None:
                    progress((base + f) / total)

            pc = packed_columns(s, hm.head) if is_packed(s) and "packed" in pls else None
            d = sc._core.advise_head(
                *sc._qkv(fn, hm.X, hm.wq, hm.wk, hm.wv), hm.scale, sc.as_mask(hm.mask, fn),
                sc.as_extras(fn, hm.biases, hm.rope), hm.head, s.heads, s.kv_heads, pc, lams,
                pls, max_saturated_fraction, min_qk_ratio, method, tol, memory_budget,
                head_progress)
            out.append(head_advice(d, layer=i, name=s.name, placements=pls,
                                   note="; ".join(notes)))
            done += 1
            if progress is not None:
                progress(done / total)
    per_layer = "all heads" if heads == "all" else (
        f"{heads} heads per layer at random (seed {seed})" if isinstance(heads, int)
        else f"heads {sorted(set(int(h) for h in heads))}")
    sampling = f"{len(out)} heads of {len(todo)} layers: {per_layer}"
    return Advice(out, lams, pls, sampling, skipped)
