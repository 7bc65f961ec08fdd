"""Plots of spectral_cond results (matplotlib, optional: pip install matplotlib).

- heatmap(rows, value="kappa_J"): a layer x head heatmap of log10 kappa from an analyze_model
  result (ModelAnalysis), a list of KappaMonitor head records, or a pandas DataFrame.
- spectra(W, corrected=...): the singular values of W and of corrected versions of it (for
  example W + lam I_k or W + C of the exact correction), on a log scale.
- monitor(records, value="kappa_J"): kappa over training steps from a KappaMonitor log (a path
  to its JSON lines, or its records): the median over heads per step with the min-max band,
  one line per layer.
- advice(result): from spectral_cond.torch.advise (or advise_head), kappa(J) (median over the
  heads) and the saturated fraction (worst head) against lambda, one line per placement, with
  the recommendation marked.

Every function draws into `ax` when given (else a new figure) and returns the Axes; nothing is
shown or saved (call fig.savefig). Non-finite values (kappa = +inf for a singular matrix) are
drawn as gaps in lines and masked cells in heatmaps, and counted in the title, never replaced by
a large finite number.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["advice", "heatmap", "monitor", "spectra"]


def _plt():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # matplotlib is optional
        raise ImportError("spectral_cond.plot needs matplotlib (pip install matplotlib)") from e
    return plt


def _axes(ax):
    if ax is not None:
        return ax
    fig, ax = _plt().subplots()
    return ax


def _rows(data: Any) -> List[dict]:
    """Dicts with layer, head and values from a ModelAnalysis, a DataFrame, records or a path."""
    if isinstance(data, str):
        from .torch import read_monitor_log

        data = read_monitor_log(data)
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # a pandas DataFrame
        return data.to_dict("records")
    out = []
    for r in data:
        if hasattr(r, "flat"):
            out.append(r.flat())
        elif isinstance(r, dict):
            out.append(r)
        else:
            raise TypeError("spectral_cond.plot: expected HeadAnalysis results, a DataFrame, "
                            f"KappaMonitor records or a log path, got {type(r).__name__}")
    return [r for r in out if r.get("kind") != "layer"]  # monitor logs: the head records


def _finite_log10(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return math.log10(f) if math.isfinite(f) and f > 0 else math.nan


def heatmap(data: Any, value: str = "kappa_J", step: Optional[int] = None, ax=None,
            cmap: str = "viridis"):
    """log10 of `value` per layer (rows) and head (columns). For monitor records, `step`
    selects the step (default: the last one)."""
    rows = _rows(data)
    if not rows:
        raise ValueError("spectral_cond.plot.heatmap: no head results to plot")
    if "step" in rows[0]:
        steps = sorted({r["step"] for r in rows})
        s = steps[-1] if step is None else step
        if s not in steps:
            raise ValueError(f"spectral_cond.plot.heatmap: no records at step {s} "
                             f"(steps {steps[0]}..{steps[-1]})")
        rows = [r for r in rows if r["step"] == s]
    layers = sorted({int(r["layer"]) for r in rows})
    heads = sorted({int(r["head"]) for r in rows})
    grid = np.full((len(layers), len(heads)), np.nan)
    infinite = 0
    for r in rows:
        v = r.get(value, math.nan)
        if isinstance(v, float) and math.isinf(v):
            infinite += 1
        grid[layers.index(int(r["layer"])), heads.index(int(r["head"]))] = _finite_log10(v)
    ax = _axes(ax)
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto", origin="upper")
    ax.set_xticks(range(len(heads)), [str(h) for h in heads])
    ax.set_yticks(range(len(layers)), [str(l) for l in layers])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    title = f"log10 {value}"
    if infinite:
        title += f" ({infinite} singular: +inf, blank)"
    ax.set_title(title)
    ax.figure.colorbar(im, ax=ax)
    return ax


def spectra(W: Any, corrected: Union[None, Any, Dict[str, Any], Sequence[Tuple[str, Any]]] = None,
            ax=None, label: str = "W"):
    """The singular values of W (descending, log scale) and of each corrected matrix:
    `corrected` is one matrix, a dict label -> matrix, or (label, matrix) pairs. The legend
    gives each one's kappa (inf when singular)."""
    from . import kappa, singular_values

    pairs: List[Tuple[str, Any]] = [(label, W)]
    if corrected is None:
        pass
    elif isinstance(corrected, dict):
        pairs += list(corrected.items())
    elif isinstance(corrected, (list, tuple)) and corrected and isinstance(corrected[0], tuple):
        pairs += list(corrected)
    else:
        pairs.append(("corrected", corrected))
    ax = _axes(ax)
    for name, M in pairs:
        sv = np.asarray(singular_values(M), dtype=float)
        k = kappa(M).kappa
        ks = "inf" if math.isinf(k) else f"{k:.3g}"
        y = np.where(sv > 0, sv, np.nan)  # a zero singular value is a gap on a log axis
        ax.semilogy(np.arange(1, sv.size + 1), y, marker=".", label=f"{name} (kappa = {ks})")
    ax.set_xlabel("i")
    ax.set_ylabel("sigma_i")
    ax.set_title("singular values")
    ax.legend()
    return ax


def monitor(data: Any, value: str = "kappa_J", layers: Optional[Iterable[int]] = None, ax=None):
    """`value` against the training step from KappaMonitor records (or its log's path): per
    layer, the median over the measured heads and the min-max band, on a log scale. Steps where
    a head's value is not finite (singular, not computed, cancelled) are left out of that
    step's statistics and counted in the title."""
    rows = _rows(data)
    if not rows or "step" not in rows[0]:
        raise ValueError("spectral_cond.plot.monitor: expected KappaMonitor records")
    want = None if layers is None else set(layers)
    by: Dict[int, Dict[int, List[float]]] = {}
    missing = 0
    for r in rows:
        L = int(r["layer"])
        if want is not None and L not in want:
            continue
        v = r.get(value, math.nan)
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not (math.isfinite(f) and f > 0):
            missing += 1
            continue
        by.setdefault(L, {}).setdefault(int(r["step"]), []).append(f)
    ax = _axes(ax)
    for L in sorted(by):
        steps = sorted(by[L])
        vals = [np.asarray(by[L][s]) for s in steps]
        med = [float(np.median(v)) for v in vals]
        lo = [float(v.min()) for v in vals]
        hi = [float(v.max()) for v in vals]
        line, = ax.semilogy(steps, med, marker=".", label=f"layer {L}")
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(value)
    title = f"{value}: median over heads, min-max band"
    if missing:
        title += f" ({missing} not finite, left out)"
    ax.set_title(title)
    if by:
        ax.legend()
    return ax


def advice(result: Any, axes=None):
    """kappa(J) (top, log scale: the median over the advised heads) and the saturated fraction of
    P's rows (bottom: the worst head) against lambda, one line per placement, from an Advice
    (spectral_cond.torch.advise) or a HeadAdvice (spectral_cond.advise_head); the recommended
    point is circled and named in the title (or the title says none, and why). `axes`: two Axes
    to draw into (else a new figure). A kappa(J) of +inf (singular J) is a gap, counted in the
    title. Returns the two Axes."""
    heads = list(result) if isinstance(result, list) else [result]
    if not heads:
        raise ValueError("spectral_cond.plot.advice: the advice holds no heads")
    best = getattr(result, "best", None)
    if axes is None:
        fig, axes = _plt().subplots(2, 1, sharex=True)
    ax_k, ax_s = axes
    points = heads[0].points
    infinite = 0
    for placement in dict.fromkeys(p.placement for p in points if p.placement != "none"):
        idx = [i for i, p in enumerate(points) if p.placement == placement]
        lams = [points[i].lam for i in idx]
        med, sat = [], []
        for i in idx:
            ks = np.array([h.points[i].J.kappa for h in heads], dtype=float)
            infinite += int(np.isinf(ks).sum())
            m = float(np.median(ks)) if ks.size else math.nan
            med.append(m if math.isfinite(m) else math.nan)
            sat.append(max(h.points[i].diagnostics.saturated_fraction
                           if h.points[i].diagnostics is not None else math.nan for h in heads))
        line, = ax_k.semilogy(lams, med, marker="o", label=placement)
        ax_s.plot(lams, sat, marker="o", color=line.get_color(), label=placement)
        if best is not None and best.found and best.placement == placement:
            j = lams.index(best.lam) if best.lam in lams else None
            if j is not None and math.isfinite(med[j]):
                ax_k.plot([best.lam], [med[j]], marker="o", markersize=14, fillstyle="none",
                          color="black", label="recommended")
    ax_k.set_ylabel("kappa(J), median over heads")
    ax_s.set_ylabel("saturated fraction (worst head)")
    ax_s.set_xlabel("lambda")
    title = f"advice over {len(heads)} head{'s' if len(heads) != 1 else ''}: "
    if best is not None and best.found:
        title += f"lambda = {best.lam:g} ({best.placement})"
    elif best is not None:
        title += "no lambda recommended"
    if infinite:
        title += f" ({infinite} singular: +inf, gaps)"
    ax_k.set_title(title)
    ax_k.legend()
    return ax_k, ax_s
