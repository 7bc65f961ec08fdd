"""The statistics of the second round (experiments/round2.py, docs/reproduction.md): every arm
against the baseline paired by seed (same initial weights, same batches), the final metric and
the area under the learning curve, two-sided p-values Holm-corrected over the arms of a task,
the speed of learning, and what the exact Jacobians and the diagnostics show per arm.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import numpy as np

import report

SPEED_FRACTION = 0.95  # speed of learning: epochs to reach 95% of the baseline's final accuracy


def holm(pvalues: Sequence[float]) -> List[float]:
    """Holm's step-down adjustment of `pvalues` (NaN entries are left out and stay NaN)."""
    idx = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    order = sorted(idx, key=lambda i: pvalues[i])
    m = len(order)
    out = [math.nan] * len(pvalues)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        out[i] = running
    return out


def _by_seed(rows, task, arm):
    """{seed: [rows sorted by epoch]} of one task and arm."""
    out: Dict[int, List[dict]] = {}
    for r in rows:
        if r["task"] == task and r["arm"] == arm:
            out.setdefault(int(r["seed"]), []).append(r)
    for v in out.values():
        v.sort(key=lambda r: int(r["epoch"]))
    return out


def _target(task, base_final_mean):
    """The speed-of-learning target: SPEED_FRACTION of the baseline's final accuracy, or a loss
    within 1 / SPEED_FRACTION of the baseline's final loss."""
    if report.metric_of(task) == "test_accuracy":
        return SPEED_FRACTION * base_final_mean
    return base_final_mean / SPEED_FRACTION


def _reached(task, value, target):
    return value >= target if report.metric_of(task) == "test_accuracy" else value <= target


def arm_stats(rows: List[dict], task: str, arms: Sequence[str]) -> List[dict]:
    """Per arm of a task: paired final and curve comparisons (Holm-corrected over the arms),
    the speed of learning and the measured quantities at initialisation and at the end."""
    from train import ARMS2

    m = report.metric_of(task)
    sign = 1.0 if m == "test_accuracy" else -1.0
    base = _by_seed(rows, task, "baseline")
    base_final = {s: float(v[-1][m]) for s, v in base.items()}
    target = _target(task, float(np.mean(list(base_final.values())))) if base_final else math.nan
    out = []
    for arm in arms:
        runs = _by_seed(rows, task, arm)
        if not runs:
            continue
        seeds = sorted(set(runs) & set(base))
        final = [float(runs[s][-1][m]) for s in seeds]
        escape = ARMS2[arm].escape if arm in ARMS2 else False
        st = dict(task=task, arm=arm, metric=m, seeds=len(runs),
                  lr=float(next(iter(runs.values()))[0].get("lr", math.nan)),
                  epochs=int(max(v[-1]["epoch"] for v in runs.values())),
                  mean=float(np.mean([float(v[-1][m]) for v in runs.values()])),
                  std=float(np.std([float(v[-1][m]) for v in runs.values()], ddof=1))
                  if len(runs) > 1 else math.nan)
        if arm != "baseline" and seeds:
            fin = report.paired(final, [base_final[s] for s in seeds])
            diffs = [sign * (a - base_final[s]) for a, s in zip(final, seeds)]
            st.update(final=fin, better=sum(d > 0 for d in diffs), tied=sum(d == 0 for d in diffs),
                      worse=sum(d < 0 for d in diffs))
            if not escape:  # the escape arm trains twice as long: its curve is not comparable
                auc = [float(np.mean([float(r[m]) for r in runs[s] if int(r["epoch"]) > 0]))
                       for s in seeds]
                bauc = [float(np.mean([float(r[m]) for r in base[s] if int(r["epoch"]) > 0]))
                        for s in seeds]
                st["curve"] = report.paired(auc, bauc)
        # Speed of learning: the first epoch whose metric reaches the target (None: never).
        reach = []
        for s in sorted(runs):
            e = next((int(r["epoch"]) for r in runs[s] if int(r["epoch"]) > 0
                      and _reached(task, float(r[m]), target)), None)
            reach.append(e)
        got = [e for e in reach if e is not None]
        st.update(speed_target=target, speed_median=float(np.median(got)) if got else math.nan,
                  speed_never=sum(e is None for e in reach))
        first = [v[0] for v in runs.values()]
        last = [v[-1] for v in runs.values()]
        mid = [v[len(v) // 2] for v in runs.values()]
        med = report._median
        st.update(
            kappa_J_init=med([r["kappa_J_median"] for r in first]),
            kappa_J_final=med([r["kappa_J_median"] for r in last]),
            kappa_J_layer_final=med([r["kappa_J_layer_median"] for r in last]),
            kappa_WQ_final=med([r["kappa_WQ_median"] for r in last]),
            saturated_init=report._mean([r["saturated_fraction"] for r in first]),
            saturated_mid=report._mean([r["saturated_fraction"] for r in mid]),
            saturated_final=report._mean([r["saturated_fraction"] for r in last]),
            ratio_QK_V_init=med([r["ratio_QK_V_median"] for r in first]),
            ratio_QK_V_final=med([r["ratio_QK_V_median"] for r in last]),
            W_norm_final=med([r["W_norm"] for r in last]),
            W_move_final=med([r["W_move"] for r in last]),
            budget=med([float(r["lr"]) * float(r["steps"]) for r in last]),
            vacuous=sum(int(r.get("free_bound_vacuous", 0) or 0) for v in runs.values() for r in v),
            rows=sum(len(v) for v in runs.values()),
            holds=all(bool(r["free_bound_holds"]) for v in runs.values() for r in v),
            not_success=sum(int(r["not_success"]) for v in runs.values() for r in v),
            train_seconds_per_epoch=float(np.mean([float(r["train_seconds"]) for v in runs.values()
                                                   for r in v if int(r["epoch"]) > 0])))
        out.append(st)
    for key in ("final", "curve"):
        have = [s for s in out if key in s]
        for s, p in zip(have, holm([s[key]["p"] for s in have])):
            s[key]["p_holm"] = p
    return out


def _ci(x, digits=4):
    if x is None:
        return "–"
    if math.isnan(x["ci_low"]):
        return f"{x['diff']:+.{digits}f} [–]"
    return f"{x['diff']:+.{digits}f} [{x['ci_low']:+.{digits}f}, {x['ci_high']:+.{digits}f}]"


def _p(x, key="p"):
    if x is None or math.isnan(x.get(key, math.nan)):
        return "–"
    return f"{x[key]:.2g}"


def results_markdown(rows, arms, advice) -> str:
    g = report._g
    lines = ["# Round two: every reading of λ I, learning rates tuned per arm", ""]
    for task in [t for t in report.TASK_ORDER if any(r["task"] == t for r in rows)]:
        sts = arm_stats(rows, task, arms)
        m = sts[0]["metric"]
        name = "test accuracy" if m == "test_accuracy" else "validation loss (nats/char)"
        unit = "accuracy" if m == "test_accuracy" else "loss"
        lines += [f"## {task}", "",
                  f"Final {name}, mean ± std over seeds. Paired by seed: Δ = arm − baseline with "
                  f"a t-interval (95%); p two-sided, Holm-corrected over the {len(sts) - 1} arms "
                  f"(p_H). Curve: the mean {unit} over epochs 1..E (area under the learning "
                  f"curve). Speed: median epoch at which a seed reaches "
                  f"{g(sts[0]['speed_target'], 4)} ({'95% of' if m == 'test_accuracy' else '1/0.95 times'}"
                  f" the baseline's final mean), and the seeds that never do.", "",
                  "| arm | lr | seeds | final | Δ final [95% CI] | p, p_H | better/tied/worse | "
                  "Δ curve [95% CI] | p, p_H | speed (never) | κ(J) init → final | "
                  "κ(J) layer final | saturated init → final | ‖J_QK‖/‖J_V‖ init → final | "
                  "vacuous bounds (heads in epoch rows) | s/epoch |",
                  "|" + "---|" * 16]
        for s in sts:
            f, c = s.get("final"), s.get("curve")
            bt = "–" if f is None else f"{s['better']}/{s['tied']}/{s['worse']}"
            lines.append(
                f"| {s['arm']} | {s['lr']:g} | {s['seeds']} | {s['mean']:.4f} ± {g(s['std'], 2)} |"
                f" {_ci(f)} | {_p(f)}, {_p(f, 'p_holm')} | {bt} | {_ci(c)} | "
                f"{_p(c)}, {_p(c, 'p_holm')} | {g(s['speed_median'])} ({s['speed_never']}) | "
                f"{g(s['kappa_J_init'])} → {g(s['kappa_J_final'])} | "
                f"{g(s['kappa_J_layer_final'])} | {s['saturated_init']:.2f} → "
                f"{s['saturated_final']:.2f} | {g(s['ratio_QK_V_init'])} → "
                f"{g(s['ratio_QK_V_final'])} | {s['vacuous']} in {s['rows']} | "
                f"{s['train_seconds_per_epoch']:.2f} |")
        lines.append("")
        esc = [s for s in sts if s["arm"].startswith("escape")]
        for s in esc:
            lines.append(
                f"Escape arm ({s['arm']}): {s['epochs']} epochs at lr {s['lr']:g} (movement budget "
                f"lr x steps = {g(s['budget'])}); at the end the "
                f"trained W has moved {g(s['W_move_final'])} in spectral norm (median over seeds, "
                f"max over layers; λ = 10), ‖W‖₂ = {g(s['W_norm_final'])}; saturated fraction "
                f"{s['saturated_init']:.2f} → {s['saturated_mid']:.2f} (middle) → "
                f"{s['saturated_final']:.2f}.")
        ex = {s["arm"]: s for s in sts}
        if "exact_refresh" in ex and "exact_fused" in ex:
            r = ex["exact_refresh"]["train_seconds_per_epoch"] / \
                ex["exact_fused"]["train_seconds_per_epoch"]
            lines.append(f"Cost of refreshing the exact correction every step: {r:.2f} x the "
                         "training time per epoch of the fixed one (single-threaded runs).")
        adv = [a for a in advice if a["task"] == task]
        if adv:
            picks: Dict[str, int] = {}
            for a in adv:
                k = (f"λ = {a['lam']:g} {a['placement']}" if a["found"] else
                     f"none ({a['reason']})")
                picks[k] = picks.get(k, 0) + 1
            lines.append("Advisor's choice at initialisation (seeds): " +
                         "; ".join(f"{k}: {v}" for k, v in sorted(picks.items())) + ".")
        lines.append("")
    return "\n".join(lines)


def summary_tree(rows, arms) -> dict:
    return {t: arm_stats(rows, t, arms) for t in report.TASK_ORDER
            if any(r["task"] == t for r in rows)}


def plot_escape(rows, arms, tasks, path) -> None:
    """The escape arms against epoch, one column per task: how far the trained W has moved and
    its size (spectral norm, max over layers) against lambda = 10, and the fraction of saturated
    rows; median over seeds, range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    for col, task in enumerate(tasks):
        for i, arm in enumerate(arms):
            runs = _by_seed(rows, task, arm)
            if not runs:
                continue
            epochs = sorted({int(r["epoch"]) for v in runs.values() for r in v})
            for row, (keys, title) in enumerate(
                    [(("W_move", "W_norm"), "‖W_t − W_0‖₂ (solid), ‖W_t‖₂ (dashed); λ = 10"),
                     (("saturated_fraction",), "saturated rows")]):
                ax = axes[row][col]
                for key, style in zip(keys, ("-", "--")):
                    med, lo, hi = [], [], []
                    for e in epochs:
                        v = np.array([float(r[key]) for s in runs.values() for r in s
                                      if int(r["epoch"]) == e], float)
                        v = v[np.isfinite(v)]
                        med.append(np.median(v) if len(v) else np.nan)
                        lo.append(v.min() if len(v) else np.nan)
                        hi.append(v.max() if len(v) else np.nan)
                    ax.plot(epochs, med, style, color=f"C{i}", label=f"{arm} {key}")
                    ax.fill_between(epochs, lo, hi, color=f"C{i}", alpha=0.15)
                if row == 0:
                    ax.axhline(10.0, color="k", lw=0.8, ls=":")
                else:
                    ax.set_ylim(0, 1.02)
                ax.set_title(f"{task}: {title}", fontsize=9)
                ax.set_xlabel("epoch")
                ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    try:
        report.write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    finally:
        plt.close(fig)


def direction_check(rows: List[dict], other: List[dict], arms: Sequence[str],
                    level: float = 0.05) -> str:
    """Every claim of significance in `rows` (an arm whose final or learning-curve difference to
    the baseline has Holm-corrected p below `level`) against a rerun with other seeds (`other`):
    does the rerun's mean paired difference have the same sign? A markdown table and a count."""
    lines = ["| task | arm | measure | Δ (seeds of the run) | p_H | Δ (other seeds) | other seeds "
             "| same direction |", "|---|---|---|---|---|---|---|---|"]
    agree = total = 0
    for task in [t for t in report.TASK_ORDER if any(r["task"] == t for r in rows)]:
        mine = {s["arm"]: s for s in arm_stats(rows, task, arms)}
        theirs = {s["arm"]: s for s in arm_stats(other, task, arms)}
        for arm, s in mine.items():
            for key, name in (("final", "final"), ("curve", "learning curve")):
                x = s.get(key)
                if x is None or not (x.get("p_holm", 1.0) < level):
                    continue
                y = theirs.get(arm, {}).get(key)
                if y is None:
                    lines.append(f"| {task} | {arm} | {name} | {x['diff']:+.4f} | "
                                 f"{x['p_holm']:.2g} | not rerun | – | – |")
                    continue
                same = (x["diff"] > 0) == (y["diff"] > 0) and y["diff"] != 0
                total += 1
                agree += same
                lines.append(f"| {task} | {arm} | {name} | {x['diff']:+.4f} | {x['p_holm']:.2g} | "
                             f"{y['diff']:+.4f} | {y['n']} | {'yes' if same else '**no**'} |")
    lines.append("")
    lines.append(f"{agree} of {total} rerun claims agree in direction.")
    return "\n".join(lines) + "\n"
