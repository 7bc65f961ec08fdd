"""Result objects: the library's result structs with attributes, a readable repr and to_dict().

Numbers are Python floats: +inf is float('inf') (a singular matrix), NaN is float('nan') (an
undefined value), never a large finite stand-in (MATH.md §4).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if math.isnan(v):
            return "nan"
        return f"{v:.6g}"
    if isinstance(v, np.ndarray):
        return f"<array {v.dtype} {v.shape}>"
    if isinstance(v, _Result):
        return v._short()
    return repr(v)


class _Result:
    """Shared repr and to_dict of the result dataclasses."""

    _repr_fields: tuple = ()

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Result):
                v = v.to_dict()
            out[f.metadata.get("key", f.name)] = v
        return out

    def _short(self) -> str:
        names = self._repr_fields or tuple(f.name for f in dataclasses.fields(self))
        return f"{type(self).__name__}(" + ", ".join(
            f"{n}={_fmt(getattr(self, n))}" for n in names
        ) + ")"

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}("]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "note" and not v:
                continue
            lines.append(f"  {f.name}={_fmt(v)},")
        lines.append(")")
        return "\n".join(lines)


@dataclass(repr=False)
class ConditionResult(_Result):
    """Condition numbers of one matrix with the evidence behind them (MATH.md §4).

    kappa is +inf when the rank is below min(m, n); kappa_plus = sigma_max / sigma_min_plus,
    sigma_min_plus the smallest singular value above rank_tol. accuracy: the estimated relative
    error of sigma_min. info: 'success', 'singular', 'not_converging', 'inaccurate' or
    'too_large' (declined before allocating: no accurate method fits the memory budget).
    """

    sigma_max: float
    sigma_min: float
    kappa: float
    sigma_min_plus: float
    kappa_plus: float
    rank: int
    rank_tol: float
    method: str
    accuracy: float
    iterations: int
    residual: float
    info: str
    note: str

    _repr_fields = ("kappa", "kappa_plus", "rank", "method", "accuracy", "info")


@dataclass(repr=False)
class JacobianConditionResult(ConditionResult):
    """kappa(J) of one attention block (MATH.md §12) and the setting it was computed in."""

    method_requested: str = "auto"
    tol: float = 1e-6
    scale: float = float("nan")
    mask: str = "none"
    N: int = 0
    D: int = 0
    d_k: int = 0
    d_v: int = 0
    biases: bool = False
    include_biases: bool = False
    rope: Optional[str] = None


@dataclass(repr=False)
class HypothesisFreeBound(_Result):
    """kappa(J) <= sigma_max(J) / sigma_N(P X) for N <= D (MATH.md §5, proven); bound is +inf
    where it does not apply (N > D, or P X rank-deficient)."""

    applicable: bool
    bound: float
    sigma_max_J: float
    sigma_max_residual: float
    sigma_N_PX: float
    accuracy: float
    info: str
    note: str

    _repr_fields = ("applicable", "bound", "accuracy")


@dataclass(repr=False)
class AttentionDiagnostics(_Result):
    """The attention pattern and the block norms of J (MATH.md §11): row maxima and entropy of
    P, saturated rows, sigma_max of J_Q, J_K, [J_Q | J_K] and J_V, ||J_QK||/||J_V||, whether
    attention collapsed to the identity, and the bound without hypothesis."""

    rows: int
    row_max_min: float
    row_max_mean: float
    entropy_mean: float
    saturated: int
    saturated_diagonal: int
    saturated_fraction: float
    sigma_max_JQ: float
    sigma_max_JK: float
    sigma_max_JQK: float
    sigma_max_JV: float
    ratio_QK_V: float
    norms_converged: bool
    collapsed: bool
    note: str
    free_bound: Optional[HypothesisFreeBound] = None
    forced: int = 0  # rows whose mask leaves one key: one-hot by construction, not "saturated"

    _repr_fields = ("row_max_mean", "entropy_mean", "saturated_fraction", "ratio_QK_V",
                    "collapsed")


def diagnostics(d: Optional[dict], free: Optional[dict] = None) -> Optional[AttentionDiagnostics]:
    if d is None:
        return None
    d = dict(d)
    f = d.pop("free_bound", None) if free is None else free
    return AttentionDiagnostics(**d, free_bound=None if f is None else HypothesisFreeBound(**f))


@dataclass(repr=False)
class Theorem34Report(_Result):
    """Every term of the paper's Theorem 3.4 (MATH.md §5) and the verdicts."""

    X: ConditionResult
    Lambda: ConditionResult
    WQ: ConditionResult
    WK: ConditionResult
    WV: ConditionResult
    P: ConditionResult
    J: ConditionResult
    JQ: Optional[ConditionResult]
    JK: Optional[ConditionResult]
    JV: Optional[ConditionResult]
    bound_applies: bool
    bound: float
    bound_plus: float
    ratio: float
    ratio_plus: float
    holds: bool
    holds_plus: bool
    vacuous: bool
    verdict: str
    diagnostics: Optional[AttentionDiagnostics] = None
    free_bound: Optional[HypothesisFreeBound] = None
    free_bound_holds: Optional[bool] = None


@dataclass(repr=False)
class ExactCorrection(_Result):
    """The exact correction C = alpha U V^T of Theorem 3.5 (MATH.md §6)."""

    C: np.ndarray
    W_corrected: np.ndarray
    alpha: float
    target: Optional[float]
    kappa_before: float
    kappa_after: float
    kappa_predicted: float
    corrected: bool
    info: str
    note: str


@dataclass(repr=False)
class LambdaCorrection(_Result):
    """W + lam I_k (Theorem 3.8, MATH.md §7) with the Weyl bound and when it applies."""

    W_corrected: np.ndarray
    lam: float = field(metadata={"key": "lambda"})
    s: float
    kappa_before: float
    kappa_after: float
    isometric_addend: bool
    weyl_applies: bool
    weyl_bound: float
    lambda_min: float
    improvement_guaranteed: bool
    info: str
    note: str


@dataclass(repr=False)
class AttentionGradients(_Result):
    """dL/dW_Q, dL/dW_K, dL/dW_V, dL/dX and those of the biases, dL/db_Q, dL/db_K, dL/db_V
    (vectors; column sums of dL/dQ, dL/dK, dL/dV), for a cotangent G = dL/dA (MATH.md §2, §10)."""

    dWQ: np.ndarray
    dWK: np.ndarray
    dWV: np.ndarray
    dX: np.ndarray
    dbQ: Optional[np.ndarray] = None
    dbK: Optional[np.ndarray] = None
    dbV: Optional[np.ndarray] = None


def _numbers(v: Any) -> Any:
    """The tool's JSON values with "inf", "-inf" and "nan" as floats, recursively."""
    if isinstance(v, dict):
        return {k: _numbers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_numbers(x) for x in v]
    if v in ("inf", "-inf", "nan"):
        return float(v)
    return v


@dataclass(repr=False)
class VerifyReport(_Result):
    """The verify sweep (MATH.md §4-7), the same report as `spectral-cond verify --format json`
    (docs/cli.md has every key): `proven` counts each proven statement's checks (held, violated,
    not_applicable, and the extended-precision re-checks), `theorem34` the paper's bound over all
    instances (with kappa and kappa_plus; `final` after the re-checks), `regimes` one dict per
    regime, `violations` every failed check with what rebuilds its instance. `proven_ok` is False
    when a proven statement failed: a bug."""

    seed: int
    instances_per_regime: int
    instances: int
    proven_ok: bool
    proven: dict
    theorem34: dict
    regimes: list
    violations: list

    _repr_fields = ("seed", "instances", "proven_ok")

    def __repr__(self) -> str:
        t = self.theorem34
        return (f"VerifyReport(seed={self.seed}, instances={self.instances}, "
                f"proven_ok={self.proven_ok}, regimes={len(self.regimes)}, "
                f"theorem34 held_plus={t['held_plus']} violated_plus={t['violated_plus']} "
                f"inconclusive_plus={t['inconclusive_plus']}, violations={len(self.violations)})")

    def to_pandas(self):
        """One row per regime (pandas is optional); the `final` counts as final_* columns."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("VerifyReport.to_pandas needs pandas (pip install pandas)") from e
        rows = []
        for r in self.regimes:
            row = {k: v for k, v in r.items() if k != "final"}
            row.update({f"final_{k}": v for k, v in r["final"].items()})
            rows.append(row)
        return pd.DataFrame(rows)

    @classmethod
    def from_json(cls, text: str) -> "VerifyReport":
        import json
        return cls(**_numbers(json.loads(text)))


def condition(d: Optional[dict]) -> Optional[ConditionResult]:
    return None if d is None else ConditionResult(**d)
