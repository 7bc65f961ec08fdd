"""spectral_cond.analyze: the tool's `analyze` for a checkpoint on disk, from Python (the layers of
MATH.md §8; the corrections of §6-7).

Every number comes from the analysis engine (engine/, the same code as the tool's analyze):
kappa of W_Q, W_K, W_V of every attention layer (and of every head's block), and kappa after
each correction (MATH.md §6-7), one row per matrix.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from . import _core
from ._results import _Result


@dataclass(repr=False)
class MatrixAnalysis(_Result):
    """One projection (head None) or one head's block of it, before and after the corrections."""

    layer: int
    prefix: str
    head: Optional[int]
    matrix: str
    tensor: str
    rows: int
    cols: int
    sigma_max: float
    sigma_min: float
    kappa: float
    rank: int
    kappa_lambda_fused: float
    kappa_lambda_per_head: float
    kappa_exact: float
    shared_by: str
    attention: str


class CheckpointAnalysis(list):
    """The MatrixAnalysis rows of analyze(), with the head counts used and to_pandas()."""

    heads_from: str = ""

    def to_pandas(self):
        """A pandas DataFrame with one row per matrix (pandas is optional)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("CheckpointAnalysis.to_pandas needs pandas (pip install pandas)") from e
        return pd.DataFrame([r.to_dict() for r in self])


def _num(v) -> float:
    """A number of the engine's JSON report: +inf and NaN are written as "inf" and "nan"."""
    return float(v)


def analyze(path, heads: Optional[int] = None, kv_heads: Optional[int] = None,
            layout: str = "auto", map: str = "", lam: float = 10.0,
            per_head: bool = False) -> CheckpointAnalysis:
    """kappa of W_Q, W_K, W_V of every attention layer of the checkpoint at `path` (any format
    open_checkpoint reads; layouts and map= as the tool's --layout and --map), with kappa after
    lam I_k fused and per head and after the exact correction; with per_head, every head's D x d
    block too. The head counts are `heads`/`kv_heads`, else those of config.json beside the
    checkpoint. The numbers are the analysis engine's, the same as `spectral-cond analyze`
    (its JSON report, docs/checkpoints.md, is what this reads)."""
    if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
        raise ValueError(f"analyze: lam must be finite and >= 0 (got {lam!r})")
    doc = json.loads(_core.analyze_checkpoint(os.fspath(path), layout, map, heads or 0,
                                              kv_heads or 0, float(lam), None, per_head, ""))
    rep = doc["checkpoints"][0]
    out = CheckpointAnalysis()
    # The engine names the tool's flag; here the argument was heads=.
    out.heads_from = rep["heads_from"].replace("--kv-heads", "kv_heads=").replace("--heads",
                                                                               "heads=")
    for L in rep["layers"]:
        def row(m, head):
            return MatrixAnalysis(
                layer=L["index"], prefix=L["prefix"], head=head,
                matrix=m[0], tensor=m[1]["tensor"],
                rows=m[1]["shape"][0], cols=m[1]["shape"][1],
                sigma_max=_num(m[1]["sigma_max"]), sigma_min=_num(m[1]["sigma_min"]),
                kappa=_num(m[1]["kappa"]), rank=m[1]["rank"],
                kappa_lambda_fused=_num(m[1]["lambda_fused"]["kappa"]),
                kappa_lambda_per_head=_num(m[1]["lambda_per_head"]["kappa"]),
                kappa_exact=_num(m[1]["exact"]["kappa"]), shared_by=L.get("shared_by", ""),
                attention=L["attention"])

        for name in ("W_Q", "W_K", "W_V"):
            out.append(row((name, L[name]), None))
        for h in L.get("per_head", []):
            for name in ("W_Q", "W_K", "W_V"):
                out.append(row((name, h[name]), h["head"]))
    return out
