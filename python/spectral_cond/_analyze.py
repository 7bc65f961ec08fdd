"""spectral_cond.analyze: the tool's `analyze` for a checkpoint on disk, from Python (the layers of
MATH.md §8; the corrections of §6-7).

Every number comes from the library's calls (open_checkpoint, layers, kappa, lambda_identity,
exact_correction): kappa of W_Q, W_K, W_V of every attention layer (and of every head's block),
and kappa after each correction (MATH.md §6-7), one row per matrix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

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


def _heads(ck, heads: Optional[int], kv_heads: Optional[int]):
    """--heads / --kv-heads, else the config.json beside the checkpoint (as the tool reads it)."""
    cfg = os.path.join(ck.directory, "config.json")
    c = _core.read_head_config(cfg) if os.path.isfile(cfg) else {}
    h = heads or c.get("heads", 0)
    kv = kv_heads or c.get("kv_heads", 0)  # heads= alone keeps config.json's kv count
    if not h:
        raise ValueError(f"{ck.path}: the number of heads is unknown; pass heads= (and kv_heads= "
                         "for grouped-query models) or put a config.json beside the checkpoint")
    source = "heads=" if heads else cfg
    return h, kv, source


def analyze(path, heads: Optional[int] = None, kv_heads: Optional[int] = None,
            layout: str = "auto", map: str = "", lam: float = 10.0,
            per_head: bool = False) -> CheckpointAnalysis:
    """kappa of W_Q, W_K, W_V of every attention layer of the checkpoint at `path` (any format
    open_checkpoint reads; layouts and --map as the tool's), with kappa after lam I_k fused and
    per head and after the exact correction; with per_head, every head's D x d block too. The
    head counts are `heads`/`kv_heads`, else those of config.json beside the checkpoint."""
    from . import kappa, lambda_identity, exact_correction, open_checkpoint

    ck = open_checkpoint(path)
    h, kv, source = _heads(ck, heads, kv_heads)
    out = CheckpointAnalysis()
    out.heads_from = source
    for L in ck.layers(layout=layout, map=map, heads=h, kv_heads=kv):
        mats = {}
        for role in ("q", "k", "v"):
            s = L[role]
            mats[role] = ck.projection(s["tensor"], s["transposed"], s["offset"], s["width"],
                                       s["block"], s["stride"])
        d = {"q": L["d_k"], "k": L["d_k"], "v": L["d_v"]}
        nh = {"q": L["heads"], "k": L["kv_heads"], "v": L["kv_heads"]}

        def row(role, W, head, E_fused, E_per_head):
            c = kappa(W)
            lf = kappa(W + lam * E_fused).kappa
            lp = kappa(W + lam * E_per_head).kappa
            ex = exact_correction(W).kappa_after
            return MatrixAnalysis(
                layer=L["index"], prefix=L["prefix"], head=head, matrix="W_" + role.upper(),
                tensor=L[role]["tensor"], rows=W.shape[0], cols=W.shape[1],
                sigma_max=c.sigma_max, sigma_min=c.sigma_min, kappa=c.kappa, rank=c.rank,
                kappa_lambda_fused=lf, kappa_lambda_per_head=lp, kappa_exact=ex,
                shared_by=L["shared_by"], attention="cross" if L["cross"] else "self")

        for role in ("q", "k", "v"):
            W = mats[role]
            D, width = W.shape
            out.append(row(role, W, None, np.eye(D, width),
                           lambda_identity(D, nh[role], d[role], "per-head")))
        if per_head:
            for j in range(L["heads"]):
                g = j // (L["heads"] // L["kv_heads"])
                for role, col in (("q", j), ("k", g), ("v", g)):
                    W = mats[role]
                    B = W[:, col * d[role]:(col + 1) * d[role]]
                    # The fused placement adds head col's slice of the whole identity.
                    E = np.eye(*W.shape)[:, col * d[role]:(col + 1) * d[role]]
                    out.append(row(role, B, j, E, np.eye(*B.shape)))
    return out
