"""The λ advisor's results (MATH.md §17): one head's grid of λ and placements of λ I with κ(J),
the attention diagnostics and the recommendation, and the recommendation over many heads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from . import _core
from ._results import AttentionDiagnostics, ConditionResult, _fmt, _Result, diagnostics

DEFAULT_LAMBDAS = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)


@dataclass(repr=False)
class AdviceChoice(_Result):
    """A λ and placement, or none (found False), with the reason in words. kappa_J is the chosen
    point's κ(J) (the median over heads for a model), baseline_kappa_J the same at λ = 0."""

    found: bool
    lam: float = field(metadata={"key": "lambda"})
    placement: str
    kappa_J: float
    baseline_kappa_J: float
    reason: str

    _repr_fields = ("found", "lam", "placement", "kappa_J", "baseline_kappa_J")

    def __str__(self) -> str:
        return self.reason


@dataclass(repr=False)
class AdvicePoint(_Result):
    """One grid point: κ of the corrected W_Q, W_K, W_V slices, κ(J) (method, stated accuracy,
    κ₊ and rank in J), the attention diagnostics with the bound without hypothesis, and whether
    it is admissible (else the reason). same_as: the index of an earlier point with the same
    weights, whose results these are (-1: computed here)."""

    lam: float = field(metadata={"key": "lambda"})
    placement: str
    kappa_WQ: float
    kappa_WK: float
    kappa_WV: float
    J: ConditionResult
    diagnostics: Optional[AttentionDiagnostics]
    same_as: int
    admissible: bool
    reason: str
    seconds: float

    _repr_fields = ("lam", "placement", "admissible")

    @property
    def kappa_J(self) -> float:
        return self.J.kappa


def _choice(d: dict) -> AdviceChoice:
    return AdviceChoice(found=d["found"], lam=d["lambda"], placement=d["placement"],
                        kappa_J=d["kappa_J"], baseline_kappa_J=d["baseline_kappa_J"],
                        reason=d["reason"])


@dataclass(repr=False)
class HeadAdvice(_Result):
    """The advice for one head (advise_head). points: placement-major, λ ascending; `baseline`
    indexes the λ = 0 point (an extra point, placement 'none', when the grid lacks λ = 0).
    weyl_threshold: per projection, the λ beyond which λ I provably lowers κ(W) (MATH.md §7).
    predicted_onset / measured_onset / token_variance: per placement (in `placements` order),
    the closed-form λ of saturation (NaN where the λ² law does not apply), the first grid λ
    whose saturated fraction exceeds the limit (NaN: none), and the var(x) of the law."""

    layer: int
    name: str
    head: int
    heads: int
    kv_heads: int
    N: int
    D: int
    d_k: int
    d_v: int
    scale: float
    placements: List[str]
    points: List[AdvicePoint]
    baseline: int
    weyl_threshold: List[float]
    predicted_onset: List[float]
    measured_onset: List[float]
    token_variance: List[float]
    best: AdviceChoice
    note: str = ""
    raw: Any = None  # the binding's dict, for the recommendation over heads

    _repr_fields = ("layer", "head", "N", "D", "d_k", "best")

    def rows(self) -> List[dict]:
        """One flat dict per grid point (what to_pandas tabulates)."""
        out = []
        for i, p in enumerate(self.points):
            dg = p.diagnostics
            fb = dg.free_bound if dg is not None else None
            out.append({
                "layer": self.layer, "name": self.name, "head": self.head, "point": i,
                "lambda": p.lam, "placement": p.placement,
                "kappa_WQ": p.kappa_WQ, "kappa_WK": p.kappa_WK, "kappa_WV": p.kappa_WV,
                "kappa_J": p.J.kappa, "kappa_plus_J": p.J.kappa_plus, "rank_J": p.J.rank,
                "method": p.J.method, "accuracy": p.J.accuracy, "info": p.J.info,
                "free_bound": fb.bound if fb is not None else math.nan,
                "saturated_fraction": dg.saturated_fraction if dg else math.nan,
                "row_max_mean": dg.row_max_mean if dg else math.nan,
                "entropy_mean": dg.entropy_mean if dg else math.nan,
                "ratio_QK_V": dg.ratio_QK_V if dg else math.nan,
                "collapsed": dg.collapsed if dg else False,
                "admissible": p.admissible, "reason": p.reason, "same_as": p.same_as,
                "seconds": p.seconds,
            })
        return out

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame(self.rows())


def head_advice(d: dict, layer: int = 0, name: str = "", placements: Sequence[str] = (),
                note: str = "") -> HeadAdvice:
    points = []
    for p in d["points"]:
        J = ConditionResult(**p["J"])
        points.append(AdvicePoint(lam=p["lambda"], placement=p["placement"],
                                  kappa_WQ=p["kappa_WQ"], kappa_WK=p["kappa_WK"],
                                  kappa_WV=p["kappa_WV"], J=J,
                                  diagnostics=diagnostics(p["diagnostics"]),
                                  same_as=p["same_as"], admissible=p["admissible"],
                                  reason=p["reason"], seconds=p["seconds"]))
    return HeadAdvice(layer=layer, name=name, head=d["head"], heads=d["heads"],
                      kv_heads=d["kv_heads"], N=d["N"], D=d["D"], d_k=d["d_k"], d_v=d["d_v"],
                      scale=d["scale"], placements=list(placements), points=points,
                      baseline=d["baseline"], weyl_threshold=list(d["weyl_threshold"]),
                      predicted_onset=list(d["predicted_onset"]),
                      measured_onset=list(d["measured_onset"]),
                      token_variance=list(d["token_variance"]), best=_choice(d["best"]),
                      note=note, raw=d)


class Advice(list):
    """The advice for a model: a list of HeadAdvice (the sampled heads), with `best` (the
    recommendation over them: the grid point admissible in every head with the least median
    κ(J)), `lambdas`, `placements` and `sampling` (which heads, and how they were chosen)."""

    def __init__(self, heads: Sequence[HeadAdvice], lambdas: Sequence[float],
                 placements: Sequence[str], sampling: str, skipped: Sequence[str] = ()):
        super().__init__(heads)
        self.lambdas = list(lambdas)
        self.placements = list(placements)
        self.sampling = sampling
        self.skipped = list(skipped)
        if heads:
            self.best = _choice(_core.recommend([h.raw for h in heads]))
        else:
            nan = float("nan")
            self.best = AdviceChoice(False, nan, "", nan, nan,
                                     "none: no head could be advised (" +
                                     ("; ".join(self.skipped) or "no heads") + ")")

    def rows(self) -> List[dict]:
        return [r for h in self for r in h.rows()]

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame(self.rows())

    def __str__(self) -> str:
        lines = [f"Advice over {len(self)} heads ({self.sampling}); lambdas "
                 f"{', '.join(_fmt(float(x)) for x in self.lambdas)}; placements "
                 f"{', '.join(self.placements)}",
                 f"best: {self.best.reason}"]
        for s in self.skipped:
            lines.append(f"skipped: {s}")
        return "\n".join(lines)

    __repr__ = __str__


def check_grid(fn: str, lambdas: Any, placements: Any) -> tuple:
    """The grid as lists, with errors that name the argument."""
    try:
        lams = [float(x) for x in lambdas]
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: lambdas must be a sequence of numbers (got {lambdas!r})")
    if not lams:
        raise ValueError(f"{fn}: lambdas: the grid of lambda is empty")
    for x in lams:
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{fn}: lambdas: every lambda must be finite and >= 0 (got {x!r})")
    if isinstance(placements, str):
        placements = [placements]
    pls = [str(p) for p in placements]
    if not pls:
        raise ValueError(f"{fn}: placements: the list of placements is empty")
    return lams, pls
