"""analyze_model: κ(W_Q), κ(W_K), κ(W_V) and κ(J) of every head of a live PyTorch model at its
real activations, with the module's own masks, RoPE, biases and scale (docs/python.md, "Models").

Every head ends in a row: answered (success, singular, …), or declined with the reason
(info "declined": what the module does that is not modelled, or where spectral_cond's model of it
does not reproduce the module's own forward), or failed with the error (info "failed"), naming the
layer and head. One head never aborts the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy as np
import torch
from torch import nn

import spectral_cond as sc
from ._results import AttentionDiagnostics, JacobianConditionResult, _Result, _fmt
from ._torch_capture import Call, HeadModel, call_model, capture, verify
from ._torch_sites import AttentionSite, find_attention

# kappa of the weights by LAPACK's gesdd where the library has it: numpy's SVD, the same
# accuracy (kappa to about eps kappa), and 7x faster than the Jacobi SVD kappa() picks by default
# for matrices of <= 64 columns (a head's block; bench/python/bench_models.py).
_WEIGHT_SVD = "lapack" if sc._core.have_lapacke() else "auto"

MASKS = ("auto", "none", "causal")


def weight_kappa(W) -> float:
    return sc.kappa(W, svd=_WEIGHT_SVD).kappa


@dataclass(repr=False)
class HeadAnalysis(_Result):
    """One head of one attention layer (one call of its module): kappa of its weights and
    kappa(J) at the captured X, with the attention diagnostics (MATH.md §11) when computed.

    info: the library's ('success', 'singular', 'not_converging', 'inaccurate', 'too_large'), or
    'declined' (not modelled, or the model did not reproduce the module: `note` says why),
    'failed' (an error, in `note`), 'not_computed' (jacobian=False, or no X)."""

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
    call: int = 0
    mask: str = "none"
    verify_error: float = float("nan")
    seconds: float = 0.0
    theorem34: Optional[Any] = None  # Theorem34Report, with analyze_model(theorem34=True)

    _repr_fields = ("layer", "head", "kappa_WQ", "kappa_WK", "kappa_WV", "kappa_J", "method",
                    "accuracy", "info")

    def flat(self) -> dict:
        """One flat row: the fields above without the nested results, and the diagnostics'
        main figures (NaN / None when they were not computed)."""
        d = self.to_dict()
        d.pop("jacobian")
        d.pop("diagnostics")
        t = d.pop("theorem34")
        d["theorem34"] = _theorem34_verdict(self.theorem34) if t is not None else None
        g = self.diagnostics
        nan = float("nan")
        d["row_max_mean"] = g.row_max_mean if g else nan
        d["entropy_mean"] = g.entropy_mean if g else nan
        d["saturated_fraction"] = g.saturated_fraction if g else nan
        d["ratio_QK_V"] = g.ratio_QK_V if g else nan
        d["collapsed"] = g.collapsed if g else None
        d["free_bound"] = g.free_bound.bound if g and g.free_bound else nan
        return d


def _theorem34_verdict(t) -> str:
    """One word for a head's Theorem 3.4 report (MATH.md §5): 'not_applicable' (biases, RoPE or
    a mask: the theorem is stated without them), 'vacuous' (its bound with kappa_plus is +inf),
    'holds' or 'fails'."""
    if not t.bound_applies:
        return "not_applicable"
    if not math.isfinite(t.bound_plus):
        return "vacuous"
    return "holds" if t.holds_plus else "fails"


# A head counts as saturated in the summary when more than this share of its rows are (MATH.md
# §11: a row is saturated when its largest weight exceeds 1 - 1e-6).
SATURATED_SHARE = 0.01


class ModelAnalysis(list):
    """The list of HeadAnalysis results of analyze_model, with to_pandas() and summary()."""

    def to_pandas(self):
        """A pandas DataFrame with one row per head (HeadAnalysis.flat())."""
        try:
            import pandas as pd
        except ImportError as e:  # pandas is optional
            raise ImportError("ModelAnalysis.to_pandas needs pandas (pip install pandas)") from e
        return pd.DataFrame([r.flat() for r in self])

    def summary(self) -> "ModelSummary":
        """One row per layer (and per call of a shared module): heads answered, median and worst
        kappa(J) (+inf where a head's J is singular), singular, collapsed and saturated heads,
        heads whose bound without hypothesis is vacuous (+inf), and heads declined or failed with
        their first reason. print() shows it as a table."""
        groups: Dict[tuple, List[HeadAnalysis]] = {}
        for r in self:
            groups.setdefault((r.layer, r.call), []).append(r)
        rows = []
        for (layer, call), rs in sorted(groups.items()):
            answered = [r for r in rs if r.info in ("success", "singular")]
            ks = np.array([r.kappa_J for r in answered], dtype=np.float64)
            diags = [r.diagnostics for r in rs if r.diagnostics is not None]
            bad = [r for r in rs if r.info in ("declined", "failed", "not_converging",
                                              "inaccurate", "too_large")]
            rows.append(dict(
                layer=layer, call=call, name=rs[0].name, heads=len(rs), answered=len(answered),
                median_kappa_J=float(np.median(ks)) if ks.size else float("nan"),
                worst_kappa_J=float(np.max(ks)) if ks.size else float("nan"),
                singular=sum(1 for r in answered if r.info == "singular"),
                collapsed=sum(1 for g in diags if g.collapsed),
                saturated=sum(1 for g in diags if g.saturated_fraction > SATURATED_SHARE),
                bound_vacuous=sum(1 for g in diags if g.free_bound is not None
                                  and math.isinf(g.free_bound.bound)),
                theorem34=_count_verdicts(rs),
                declined=sum(1 for r in rs if r.info == "declined"),
                failed=sum(1 for r in rs if r.info == "failed"),
                not_answered=len(bad),
                first_reason=(f"head {bad[0].head}: {bad[0].info}: {bad[0].note}" if bad else ""),
            ))
        return ModelSummary(rows)


def _count_verdicts(rs) -> str:
    """'holds 3, vacuous 1' over the heads with a Theorem 3.4 report, '' without any."""
    from collections import Counter

    c = Counter(_theorem34_verdict(r.theorem34) for r in rs if r.theorem34 is not None)
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


class ModelSummary:
    """ModelAnalysis.summary(): `rows` (one dict per layer), to_pandas(), and a table as str()."""

    COLUMNS = ("layer", "call", "heads", "answered", "median_kappa_J", "worst_kappa_J",
               "singular", "collapsed", "saturated", "bound_vacuous", "theorem34", "declined",
               "failed")

    def __init__(self, rows: List[dict]):
        self.rows = rows

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame(self.rows)

    def __str__(self) -> str:
        shown = [c for c in self.COLUMNS
                 if (c != "call" or any(r["call"] for r in self.rows))
                 and (c != "theorem34" or any(r["theorem34"] for r in self.rows))]
        head = {"median_kappa_J": "median κ(J)", "worst_kappa_J": "worst κ(J)",
                "bound_vacuous": "bound=inf"}
        cells = [[head.get(c, c) for c in shown]]
        for r in self.rows:
            cells.append([_fmt(r[c]) if isinstance(r[c], float) else str(r[c]) for c in shown])
        widths = [max(len(row[i]) for row in cells) for i in range(len(shown))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        reasons = [f"layer {r['layer']}"
                   + (f" call {r['call']}" if r["call"] else "") + f": {r['first_reason']}"
                   for r in self.rows if r["first_reason"]]
        if reasons:
            lines.append("not answered (first per layer):")
            lines.extend("  " + s for s in reasons)
        lines.append("saturated: more than 1% of rows with a weight above 1 - 1e-6; collapsed: "
                     "P = I, query/key gradients dead (MATH.md §11); bound=inf: the bound without "
                     "hypothesis is vacuous (MATH.md §5); theorem34 (with theorem34=True): its "
                     "bound with kappa_plus per head, not_applicable with biases, RoPE or masks")
        return "\n".join(lines)

    __repr__ = __str__


def _structural(hm: HeadModel, method: str, tol: float) -> JacobianConditionResult:
    """κ(J) = +inf without computing anything: rows of J vanish (the module outputs 0 for query
    rows that attend to no key) or repeat (two such rows share one output)."""
    why = ("the module outputs 0 for query rows " if hm.dead_kind == "zero" else
           "the module gives query rows ")
    why += ", ".join(str(int(i)) for i in hm.dead_rows[:6])
    why += (" (which attend to no key), so those rows of J are 0" if hm.dead_kind == "zero" else
            " (which attend to no key) one shared output, so those rows of J are equal")
    nan = float("nan")
    N, D = hm.X.shape
    return JacobianConditionResult(
        sigma_max=nan, sigma_min=0.0, kappa=float("inf"), sigma_min_plus=nan, kappa_plus=nan,
        rank=-1, rank_tol=nan, method="structure", accuracy=0.0, iterations=0, residual=0.0,
        info="singular", note=why + ": J is singular exactly (sigma_max, rank and kappa_plus "
        "not computed)", method_requested=method, tol=tol,
        scale=hm.scale if hm.scale is not None else 1 / math.sqrt(hm.wq.shape[1]),
        mask="additive", N=N, D=D, d_k=hm.wq.shape[1], d_v=hm.wv.shape[1],
        biases=hm.biases is not None, rope=None if hm.rope is None else hm.rope.pairing)


def _mask_name(mask) -> str:
    if mask is None:
        return "none"
    return mask if isinstance(mask, str) else "additive"


def head_theorem34(hm: HeadModel, J, method: str, tol: float):
    """Theorem 3.4's report for the head with its kappa(J) reused (None where it cannot be had),
    and a note when it failed."""
    if J is None or J.info not in ("success", "singular") or J.method == "structure":
        return None, None
    try:
        return sc.theorem34(hm.X, hm.wq, hm.wk, hm.wv, method=method, tol=tol, scale=hm.scale,
                            mask=hm.mask, biases=hm.biases, rope=hm.rope, blocks=False,
                            jacobian=J), None
    except (RuntimeError, MemoryError, ValueError, ArithmeticError) as e:
        return None, f"theorem34 not computed ({type(e).__name__}: {e})"


def head_kappa(hm: HeadModel, method: str, tol: float, diagnostics: bool,
               progress: Optional[Callable[[float], Any]] = None, memory_budget: int = 0):
    """(κ(J) result or None, diagnostics or None, info, notes) for one head model. Errors of
    the library are caught and returned as info "failed"; a progress callback's exceptions
    propagate (they cancel)."""
    notes: List[str] = []
    if hm.refusal:
        return None, None, "declined", [hm.refusal]
    if hm.X is None:
        return None, None, "not_computed", notes
    if hm.dead_kind:
        J = _structural(hm, method, tol)
        return J, None, "singular", [J.note]
    try:
        J = sc.kappa_jacobian(hm.X, hm.wq, hm.wk, hm.wv, method=method, tol=tol, scale=hm.scale,
                              mask=hm.mask, biases=hm.biases, rope=hm.rope, progress=progress,
                              memory_budget=memory_budget)
    except (RuntimeError, MemoryError, ValueError, ArithmeticError) as e:
        return None, None, "failed", [f"{type(e).__name__}: {e}"]
    if J.note:
        notes.append(J.note)
    diag = None
    if diagnostics and J.info != "too_large":
        try:
            diag = sc.attention_diagnostics(hm.X, hm.wq, hm.wk, hm.wv, scale=hm.scale,
                                            mask=hm.mask, biases=hm.biases, rope=hm.rope)
            if diag.note:
                notes.append(diag.note)
        except (RuntimeError, MemoryError, ValueError, ArithmeticError) as e:
            notes.append(f"diagnostics not computed ({type(e).__name__}: {e})")
    return J, diag, J.info, notes


def head_models(site: AttentionSite, call: Optional[Call], sample: int, mask: str,
                check: bool, copies: Dict[int, nn.Module], WQ, WK, WV):
    """The per-head models of one call (or, without a call, heads with no X) and call notes."""
    if call is None:
        d = site.head_dim
        group = site.heads // site.kv_heads
        out = []
        for h in range(site.heads):
            g = h // group
            out.append(HeadModel(h, g, None, WQ[:, h * d:(h + 1) * d], WK[:, g * d:(g + 1) * d],
                                 WV[:, g * d:(g + 1) * d], site.scale, None, None, None,
                                 np.zeros(0, dtype=np.int64)))
        return out, []
    heads, notes = call_model(site, call, sample, WQ, WK, WV)
    if mask != "auto":
        for hm in heads:
            hm.mask = None if mask == "none" else "causal"
            hm.dead_rows = np.zeros(0, dtype=np.int64)
        notes = [f"kappa(J) with mask='{mask}' as requested, not the module's own mask (not "
                 "checked against the module's forward)"]
    elif check:
        how = verify(site, call, sample, heads, copies)
        if how:
            notes.append(how)
    return heads, notes


def selected_sites(fn: str, model: nn.Module, layers: Optional[Iterable[int]]):
    """The model's attention sites and the set of selected layer indices (None: all), with errors
    that name `fn`: no attention module found, or a layer that does not exist."""
    sites = find_attention(model)
    if not sites:
        raise ValueError(f"{fn}: the model has no attention module spectral_cond knows "
                         "(docs/python.md, 'Models', lists them)")
    wanted = None if layers is None else set(int(i) for i in layers)
    if wanted is not None and not wanted <= set(range(len(sites))):
        raise ValueError(f"{fn}: layers {sorted(wanted - set(range(len(sites))))} do not exist "
                         f"(the model has {len(sites)} attention layers, 0 to {len(sites) - 1})")
    return sites, wanted


def check_arguments(fn: str, method: str, tol: float, mask: str, sample: int) -> None:
    methods = ("auto", "dense", "gram", "iterative", "lobpcg", "matfree", "qr")
    if method not in methods:
        raise ValueError(f"{fn}: method must be one of {', '.join(methods)} (got {method!r})")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"{fn}: tol must be > 0 (got {tol!r})")
    if mask not in MASKS:
        raise ValueError(f"{fn}: mask must be 'auto' (the module's own), 'none' or 'causal' "
                         f"(got {mask!r})")
    if not (isinstance(sample, int) and sample >= 0):
        raise ValueError(f"{fn}: sample must be an int >= 0 (got {sample!r})")


def analyze_model(model: nn.Module, inputs: Any, method: str = "auto", tol: float = 1e-6,
                  mask: str = "auto", sample: int = 0, jacobian: bool = True,
                  layers: Optional[Iterable[int]] = None,
                  progress: Optional[Callable[[float], Any]] = None,
                  diagnostics: bool = True, calls: str = "all",
                  check: bool = True, memory_budget: int = 0,
                  theorem34: bool = False) -> ModelAnalysis:
    """Runs `model` on `inputs` (a tensor, a tuple of positional arguments, or a dict of keyword
    arguments) in eval mode without gradients, captures each attention module's arguments by
    hooks, and returns per layer and head kappa(W_Q), kappa(W_K), kappa(W_V) (the head's D x d
    block, MATH.md §4) and kappa(J) of that head at its real input X (sample `sample` of the
    batch) by kappa_jacobian with `method` and `tol` (MATH.md §12), with the attention
    diagnostics (MATH.md §11) when `diagnostics`.

    Attention as the module computes it (docs/python.md, "Models"): its causal flag and the mask
    it is given (padding, sliding window, relative position bias), its RoPE from the angles it is
    given (any rope_type, partial rotary, rotate_half or interleaved), grouped-query heads, Q/K/V
    biases and logit scale. With `check` (default), each head's model is compared with a float64
    re-run of the module; a head that differs is declined (info 'declined', the difference in
    the note), as is every head of a module with features not modelled (query/key normalisation,
    soft-capping, ALiBi, cross-attention). mask='none' or 'causal' replaces the module's mask
    (a what-if, not checked). A module called more than once (shared layers, as ALBERT's) is
    analysed at every call (`calls='all'`, the row's `call`) or at its first (`calls='first'`).
    `progress` is called with the fraction of heads done. `memory_budget` (bytes, 0: a quarter
    of the machine's memory) bounds each kappa(J) computation; a head that no accurate method
    can take within it is declined from its shapes before anything is allocated (info
    'too_large', the sizes in the note). With `theorem34`, each answered head also gets
    Theorem 3.4 term by term (MATH.md §5; its kappa(J) reused), and the summary counts where the
    bound holds, fails, is vacuous or does not apply. With jacobian=False the model is not run
    (`inputs` is not used) and N is 0.
    """
    fn = "analyze_model"
    check_arguments(fn, method, tol, mask, sample)
    if calls not in ("all", "first"):
        raise ValueError(f"{fn}: calls must be 'all' or 'first' (got {calls!r})")
    sites, wanted = selected_sites(fn, model, layers)
    captured = capture(model, sites, wanted, inputs) if jacobian else None
    todo = [(i, s) for i, s in enumerate(sites) if wanted is None or i in wanted]
    plan = []
    for i, s in todo:
        cs = captured.get(i, []) if captured is not None else [None]
        if captured is not None and not cs:
            cs = [None]
        if calls == "first":
            cs = cs[:1]
        plan.append((i, s, cs))
    total = sum(s.heads * len(cs) for _, s, cs in plan) or 1
    done = 0
    out = ModelAnalysis()
    copies: Dict[int, nn.Module] = {}
    for i, s, cs in plan:
        WQ, WK, WV = s.q.W(), s.k.W(), s.v.W()
        wk = [(weight_kappa(WQ[:, h * s.head_dim:(h + 1) * s.head_dim])) for h in range(s.heads)]
        for c_index, call in enumerate(cs):
            where = f"layer {i} ({s.name})" + (f", call {c_index}" if len(cs) > 1 else "")
            base = list(s.notes)
            if captured is not None and call is None:
                base.append("the module did not run on these inputs: no X, kappa(J) not computed")
            if len(cs) > 1:
                base.append(f"the module is called {len(cs)} times (shared weights): call "
                            f"{c_index} of {len(cs)}")
            try:
                heads, cnotes = head_models(s, call, sample, mask, check, copies, WQ, WK, WV)
            except Exception as e:
                raise type(e)(f"{fn}: {where}: {e}") from e
            for hm in heads:
                t0 = _now()
                J, diag, info, hnotes = head_kappa(hm, method, tol, diagnostics,
                                                   memory_budget=memory_budget)
                t34 = None
                if theorem34:
                    t34, why = head_theorem34(hm, J, method, tol)
                    if why:
                        hnotes = hnotes + [why]
                notes = base + cnotes + hnotes
                if info == "failed":
                    notes = base + [f"{where}, head {hm.head}: {hnotes[0]}"]
                if J is not None and (hm.biases is not None or hm.rope is not None):
                    notes.append("kappa(J) with the module's " + " and ".join(
                        w for w, on in (("biases", hm.biases is not None),
                                        ("RoPE", hm.rope is not None)) if on) + " (MATH.md §10)")
                nan = float("nan")
                out.append(HeadAnalysis(
                    layer=i, name=s.name, kind=s.kind, head=hm.head, kv_head=hm.kv_head,
                    N=0 if hm.X is None else hm.X.shape[0], D=s.D, d_k=s.head_dim,
                    d_v=s.head_dim,
                    scale=s.scale if s.scale is not None else 1.0 / math.sqrt(s.head_dim),
                    kappa_WQ=wk[hm.head], kappa_WK=weight_kappa(hm.wk),
                    kappa_WV=weight_kappa(hm.wv),
                    kappa_J=J.kappa if J else nan, kappa_plus_J=J.kappa_plus if J else nan,
                    method=J.method if J else "", accuracy=J.accuracy if J else nan,
                    info=info, has_bias=s.has_bias, rope=hm.rope is not None,
                    note="; ".join(notes), jacobian=J, diagnostics=diag, call=c_index,
                    mask=_mask_name(hm.mask), verify_error=hm.verify_error,
                    seconds=_now() - t0, theorem34=t34))
                done += 1
                if progress is not None:
                    progress(done / total)
    return out


def _now() -> float:
    import time

    return time.perf_counter()
