"""Aggregation, tables and plots of the training experiment (docs/reproduction.md).

Per epoch of a run, over its heads: median and max of kappa(W_Q), kappa(W_K), kappa(W_V) (each
head's D x d block of the effective weight) and of kappa(J); kappa(J) of each layer (its heads
side by side: max_h sigma_max(J_h) / min_h sigma_min(J_h), MATH.md §8); the bound without
hypothesis (MATH.md §5) and whether every head's kappa(J) is under it; the attention diagnostics
(MATH.md §11). Per arm, over seeds: the final metric's mean and standard deviation and a Welch
95% confidence interval for its difference to the baseline.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Dict, Iterable, List, Sequence

import numpy as np

EPOCH_COLUMNS = (
    "task", "arm", "seed", "epoch", "train_loss", "test_loss", "test_accuracy",
    "kappa_WQ_median", "kappa_WQ_max", "kappa_WK_median", "kappa_WK_max", "kappa_WV_median",
    "kappa_WV_max", "kappa_J_median", "kappa_J_max", "kappa_J_layer_median", "kappa_J_layer_max",
    "free_bound_median", "free_bound_holds", "free_bound_vacuous", "methods", "accuracy_max",
    "not_success",
    "row_max_mean", "entropy_mean", "saturated_fraction", "ratio_QK_V_median",
    "collapsed_fraction", "train_seconds", "measure_seconds")

TASK_ORDER = ("vision", "shapes", "language")

HEAD_COLUMNS = (
    "task", "arm", "seed", "epoch", "layer", "head", "N", "D", "kappa_WQ", "kappa_WK", "kappa_WV",
    "kappa_J", "kappa_plus_J", "sigma_min_J", "sigma_max_J", "method", "accuracy", "info",
    "free_bound", "row_max_mean", "row_max_min", "entropy_mean", "saturated_fraction",
    "ratio_QK_V", "collapsed", "seconds", "note")


def _median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.median(xs)) if xs else float("nan")


def _max(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(max(xs)) if xs else float("nan")


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.mean(xs)) if xs else float("nan")


def epoch_rows(result: dict) -> List[dict]:
    """One row per epoch of a run: its metrics and the aggregates of its head records."""
    heads: Dict[int, List[dict]] = {}
    for r in result["records"]:
        if r["kind"] == "head":
            heads.setdefault(r["epoch"], []).append(r)
    rows = []
    for e in result["epochs"]:
        hs = heads.get(e["epoch"], [])
        row = {k: e.get(k, float("nan")) for k in EPOCH_COLUMNS if k in e}
        for w in ("WQ", "WK", "WV", "J"):
            vals = [h[f"kappa_{w}"] for h in hs]
            row[f"kappa_{w}_median"] = _median(vals)
            row[f"kappa_{w}_max"] = _max(vals)
        layers: Dict[int, List[dict]] = {}
        for h in hs:
            layers.setdefault(h["layer"], []).append(h)
        per_layer = []
        for ls in layers.values():
            # A layer with a singular head (kappa(J) = +inf, its sigma_min at or below the rank
            # tolerance) is singular: +inf, never the huge finite ratio of a rounded sigma_min.
            if any(math.isinf(h["kappa_J"]) or h["info"] == "singular" for h in ls):
                per_layer.append(math.inf)
                continue
            smax = max(h["sigma_max_J"] for h in ls)
            smin = min(h["sigma_min_J"] for h in ls)
            per_layer.append(math.inf if smin == 0 else smax / smin)
        row["kappa_J_layer_median"] = _median(per_layer)
        row["kappa_J_layer_max"] = _max(per_layer)
        fb = [h["free_bound"] for h in hs]
        row["free_bound_median"] = _median(fb)
        # The bound is proven; a head over it (beyond the two stated accuracies) would be a defect.
        slack = 64 * np.finfo(float).eps  # the bound's own rounding, beyond kappa(J)'s accuracy
        row["free_bound_holds"] = all(
            not (h["kappa_J"] > h["free_bound"] * (1 + h["accuracy"] + slack))
            for h in hs if not math.isnan(h["free_bound"]) and not math.isnan(h["kappa_J"]))
        # An infinite bound holds vacuously: it confirms nothing, and is counted apart.
        row["free_bound_vacuous"] = sum(math.isinf(h["free_bound"]) for h in hs)
        row["methods"] = "|".join(sorted({h["method"] for h in hs}))
        row["accuracy_max"] = _max([h["accuracy"] for h in hs])
        row["not_success"] = sum(h["info"] != "success" for h in hs)
        row["row_max_mean"] = _mean([h["row_max_mean"] for h in hs])
        row["entropy_mean"] = _mean([h["entropy_mean"] for h in hs])
        row["saturated_fraction"] = _mean([h["saturated_fraction"] for h in hs])
        row["ratio_QK_V_median"] = _median([h["ratio_QK_V"] for h in hs])
        row["collapsed_fraction"] = (sum(bool(h["collapsed"]) for h in hs) / len(hs)
                                     if hs else float("nan"))
        rows.append(row)
    return rows


def _cell(v):
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    return v


def write_csv(path: str, rows: Iterable[dict], columns: Sequence[str]) -> None:
    """CSV with the given columns; NaN as an empty cell, infinities as inf / -inf, floats with
    repr's round-trip digits."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _cell(r.get(k, "")) for k in columns})
    write_atomic(path, buf.getvalue())


def write_atomic(path: str, text_or_writer) -> None:
    """Writes `path` through a temporary file in its folder renamed over it, so a failed run
    leaves no half-written file: `text_or_writer` is the text, or a function writing to a path."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-",
                               suffix=os.path.splitext(path)[1])
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make every output private
    try:
        if callable(text_or_writer):
            os.close(fd)
            text_or_writer(tmp)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(text_or_writer)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def json_value(v):
    """The KappaMonitor log's encoding (+inf as "inf", NaN as null), numpy scalars as Python's."""
    from spectral_cond._torch_monitor import _json_value

    if isinstance(v, (np.floating, np.integer, np.bool_)):
        v = v.item()
    return _json_value(v)


def json_value_tree(v):
    """json_value applied through dicts, lists and tuples."""
    if isinstance(v, dict):
        return {k: json_value_tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value_tree(x) for x in v]
    return json_value(v)


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    write_atomic(path, "".join(json.dumps({k: json_value(v) for k, v in r.items()}) + "\n"
                                for r in records))


def welch(a: Sequence[float], b: Sequence[float], level: float = 0.95):
    """Mean of a - mean of b and its Welch confidence interval (NaN with fewer than 2 each)."""
    from scipy import stats

    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, float("nan"), float("nan")
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    q = float(stats.t.ppf(0.5 + level / 2, dof))
    return diff, diff - q * se, diff + q * se


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.95):
    """The arms are paired by seed (same initial weights, same batches): the mean of the
    per-seed differences a_s - b_s, its t confidence interval, the t statistic and its
    two-sided p-value (NaN with fewer than 2 pairs; t = +-inf where every difference is equal
    and not zero)."""
    from scipy import stats

    d = np.asarray(a, float) - np.asarray(b, float)
    mean = float(d.mean()) if len(d) else float("nan")
    if len(d) < 2:
        return dict(diff=mean, ci_low=float("nan"), ci_high=float("nan"), t=float("nan"),
                    p=float("nan"), n=len(d))
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    if se == 0:
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        return dict(diff=mean, ci_low=mean, ci_high=mean, t=t, p=1.0 if mean == 0 else 0.0,
                    n=len(d))
    q = float(stats.t.ppf(0.5 + level / 2, len(d) - 1))
    t = mean / se
    return dict(diff=mean, ci_low=mean - q * se, ci_high=mean + q * se, t=t,
                p=float(2 * stats.t.sf(abs(t), len(d) - 1)), n=len(d))


def paired_by_epoch(rows: List[dict], task: str, arm: str, baseline: str = "baseline"):
    """Per epoch: the paired comparison of `arm` with the baseline on the task's metric, and
    the seeds where the arm was better, tied or worse (higher accuracy, lower loss)."""
    metric = metric_of(task)
    sign = 1.0 if metric == "test_accuracy" else -1.0
    by = {}
    for r in rows:
        if r["task"] == task and r["arm"] in (arm, baseline):
            v = float(r[metric]) if r[metric] not in ("", None) else float("nan")
            by.setdefault(int(r["epoch"]), {}).setdefault(r["arm"], {})[int(r["seed"])] = v
    out = []
    for e in sorted(by):
        A, B = by[e].get(arm, {}), by[e].get(baseline, {})
        seeds = sorted(set(A) & set(B))
        a = [A[s] for s in seeds]
        b = [B[s] for s in seeds]
        diffs = [sign * (x - y) for x, y in zip(a, b)]
        res = paired(a, b)
        res.update(epoch=e, better=sum(d > 0 for d in diffs), tied=sum(d == 0 for d in diffs),
                   worse=sum(d < 0 for d in diffs))
        out.append(res)
    return out


def metric_of(task: str) -> str:
    return "test_accuracy" if task in ("vision", "shapes") else "test_loss"


def summary(rows: List[dict], arms: Sequence[str]) -> List[dict]:
    """Per task and arm, over seeds, at the last epoch of each run (and at epoch 0)."""
    out = []
    for task in sorted({r["task"] for r in rows}, key=TASK_ORDER.index):
        metric = metric_of(task)
        last: Dict[str, Dict[int, dict]] = {}
        first: Dict[str, Dict[int, dict]] = {}
        for r in rows:
            if r["task"] != task:
                continue
            s = last.setdefault(r["arm"], {})
            if r["seed"] not in s or r["epoch"] > s[r["seed"]]["epoch"]:
                s[r["seed"]] = r
            if r["epoch"] == 0:
                first.setdefault(r["arm"], {})[r["seed"]] = r
        base = [last["baseline"][s][metric] for s in sorted(last.get("baseline", {}))]
        for arm in arms:
            if arm not in last:
                continue
            seeds = sorted(last[arm])
            vals = [last[arm][s][metric] for s in seeds]
            d, lo, hi = welch(vals, base) if arm != "baseline" and base else (
                float("nan"),) * 3
            paired = [last[arm][s][metric] - last["baseline"][s][metric]
                      for s in seeds if s in last.get("baseline", {})]
            better = (sum(p > 0 for p in paired) if metric == "test_accuracy"
                      else sum(p < 0 for p in paired))
            L = [last[arm][s] for s in seeds]
            F = [first[arm][s] for s in seeds if s in first.get(arm, {})]
            out.append(dict(
                task=task, arm=arm, metric=metric, seeds=len(seeds),
                epochs=int(max(r["epoch"] for r in L)),
                mean=float(np.mean(vals)), std=float(np.std(vals, ddof=1)) if len(vals) > 1
                else float("nan"),
                diff=d, ci_low=lo, ci_high=hi,
                better_seeds=better if arm != "baseline" else None,
                paired_seeds=len(paired) if arm != "baseline" else None,
                kappa_J_init=_median([r["kappa_J_median"] for r in F]),
                kappa_J_final=_median([r["kappa_J_median"] for r in L]),
                kappa_J_layer_final=_median([r["kappa_J_layer_median"] for r in L]),
                kappa_WQ_final=_median([r["kappa_WQ_median"] for r in L]),
                saturated_init=_mean([r["saturated_fraction"] for r in F]),
                saturated_final=_mean([r["saturated_fraction"] for r in L]),
                collapsed_init=_mean([r["collapsed_fraction"] for r in F]),
                collapsed_final=_mean([r["collapsed_fraction"] for r in L]),
                ratio_QK_V_final=_median([r["ratio_QK_V_median"] for r in L]),
                free_bound_holds=all(r["free_bound_holds"] for r in rows
                                     if r["task"] == task and r["arm"] == arm),
                not_success=sum(r["not_success"] for r in rows
                                if r["task"] == task and r["arm"] == arm)))
    return out


def _g(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def markdown_table(summ: List[dict]) -> str:
    """The results table (one per task), with the digits reproduction is promised to."""
    lines = []
    for task in sorted({s["task"] for s in summ}, key=TASK_ORDER.index):
        rows = [s for s in summ if s["task"] == task]
        metric = rows[0]["metric"]
        name = "test accuracy" if metric == "test_accuracy" else "validation loss (nats/char)"
        lines += [f"**{task}** — final {name}, mean ± std over seeds; difference to the "
                  "baseline with a Welch 95% CI; seeds where the arm beat the baseline",
                  "",
                  "| arm | seeds | final | Δ vs baseline [95% CI] | better | κ(J) init | "
                  "κ(J) final | κ(J) layer final | κ(W_Q) final | saturated init → final | "
                  "collapsed heads init → final | ‖J_QK‖/‖J_V‖ final |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in rows:
            if s["arm"] == "baseline":
                delta = "–"
            elif math.isnan(s["ci_low"]):
                delta = f"{s['diff']:+.4f} [–]"  # one seed: no interval
            else:
                delta = f"{s['diff']:+.4f} [{s['ci_low']:+.4f}, {s['ci_high']:+.4f}]"
            better = "–" if s["arm"] == "baseline" else f"{s['better_seeds']}/{s['paired_seeds']}"
            lines.append(
                f"| {s['arm']} | {s['seeds']} | {s['mean']:.4f} ± {_g(s['std'], 2)} | {delta} | "
                f"{better} | {_g(s['kappa_J_init'])} | {_g(s['kappa_J_final'])} | "
                f"{_g(s['kappa_J_layer_final'])} | {_g(s['kappa_WQ_final'])} | "
                f"{s['saturated_init']:.2f} → {s['saturated_final']:.2f} | "
                f"{s['collapsed_init']:.2f} → {s['collapsed_final']:.2f} | "
                f"{_g(s['ratio_QK_V_final'])} |")
        lines.append("")
    return "\n".join(lines)


def paired_table(rows: List[dict], arms: Sequence[str]) -> str:
    """The arms against the baseline paired by seed (same initial weights and batches): at the
    last epoch, and over the whole learning curve (the mean of the metric over epochs 1..E per
    seed, a measure of the speed of learning); the seeds better, tied and worse; the epochs at
    which every seed was better; and the head measurements whose bound was +inf (vacuous: it
    holds, and confirms nothing)."""
    lines = []
    for task in [t for t in TASK_ORDER if any(r["task"] == t for r in rows)]:
        metric = metric_of(task)
        lines += [f"**{task}** — paired by seed: Δ = arm − baseline, t-interval (95%), t and "
                  "two-sided p; learning curve = mean of the metric over epochs 1..E",
                  "",
                  "| arm | final Δ [95% CI] | t, p | better / tied / worse | curve Δ [95% CI] | "
                  "t, p | epochs with every seed better | vacuous bounds |",
                  "|---|---|---|---|---|---|---|---|"]

        def curve(arm):
            per = {}
            for r in rows:
                if r["task"] == task and r["arm"] == arm and int(r["epoch"]) > 0:
                    per.setdefault(int(r["seed"]), []).append(float(r[metric]))
            return per

        base_curve = curve("baseline")
        for arm in arms:
            if arm == "baseline":
                continue
            pe = paired_by_epoch(rows, task, arm)
            if not pe:
                continue
            last = pe[-1]
            c = curve(arm)
            seeds = sorted(set(c) & set(base_curve))
            cu = paired([float(np.mean(c[s])) for s in seeds],
                        [float(np.mean(base_curve[s])) for s in seeds])
            every = [p["epoch"] for p in pe if p["epoch"] > 0 and p["n"] and p["better"] == p["n"]]
            vac = sum(int(r.get("free_bound_vacuous", 0) or 0) for r in rows
                      if r["task"] == task and r["arm"] == arm)
            heads = sum(1 for r in rows if r["task"] == task and r["arm"] == arm)

            def ci(x):
                return (f"{x['diff']:+.4f} [–]" if math.isnan(x["ci_low"]) else
                        f"{x['diff']:+.4f} [{x['ci_low']:+.4f}, {x['ci_high']:+.4f}]")

            def tp(x):
                return "–" if math.isnan(x["t"]) else f"{x['t']:.2f}, {x['p']:.2g}"

            lines.append(f"| {arm} | {ci(last)} | {tp(last)} | {last['better']} / {last['tied']}"
                         f" / {last['worse']} | {ci(cu)} | {tp(cu)} | "
                         f"{len(every)} of {len(pe) - 1} | {vac} (in {heads} epoch rows) |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: List[dict], arms: Sequence[str], task: str, path: str) -> None:
    """One figure per task: kappa(J) (median over heads), the metric, the training loss,
    kappa(W_Q), the saturated fraction of rows and ||J_QK||/||J_V|| against epoch, per arm: the
    median over seeds as a line, the range over seeds shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("kappa_J_median", "κ(J), median over heads", True),
              (metric_of(task), "test accuracy" if metric_of(task) == "test_accuracy" else "validation loss", False),
              ("train_loss", "training loss", task == "language"),
              ("kappa_WQ_median", "κ(W_Q) of the effective weight, median", True),
              ("saturated_fraction", "saturated rows (max P_ij > 1 - 1e-6)", False),
              ("ratio_QK_V_median", "‖J_QK‖ / ‖J_V‖, median", True)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for i, arm in enumerate(arms):
            rs = [r for r in rows if r["task"] == task and r["arm"] == arm]
            if not rs:
                continue
            epochs = sorted({r["epoch"] for r in rs})
            med, lo, hi = [], [], []
            for e in epochs:
                v = np.array([r[key] for r in rs if r["epoch"] == e], float)
                v = v[~np.isnan(v)]
                if log:
                    v = v[v > 0]
                v = np.where(np.isinf(v), np.nan, v)
                finite = v[~np.isnan(v)]
                med.append(np.median(finite) if len(finite) else np.nan)
                lo.append(finite.min() if len(finite) else np.nan)
                hi.append(finite.max() if len(finite) else np.nan)
            color = f"C{i}"
            ax.plot(epochs, med, color=color, label=arm, marker="." if len(epochs) < 3 else None)
            ax.fill_between(epochs, lo, hi, color=color, alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{task}: median over seeds (line) and range (band)")
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    finally:
        plt.close(fig)
