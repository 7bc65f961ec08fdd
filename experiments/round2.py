#!/usr/bin/env python3
"""The second round of the training experiment (docs/reproduction.md, "Round two"): every
reading of lambda I (the arms of train.ARMS2) on three tasks, the learning rate chosen per arm
on a validation split of the training data, kappa(J) measured every epoch, and statistics
paired by seed with Holm's correction over arms.

  .venv-py/bin/python experiments/round2.py                  the full run (all three tasks)
  .venv-py/bin/python experiments/round2.py --tasks vision   one task (the others stay cached)
  .venv-py/bin/python experiments/round2.py --quick          tiny sizes, one seed: the pipeline

Phase 1 (tuning): every arm but the escape arm, at each learning rate of the task's grid
(TUNE_LRS), trained on the training data less a validation split and evaluated on that split,
seed TUNE_SEED, no kappa measurement; the arm's learning rate is the one with the best final
validation metric. Phase 2: every arm at its learning rate, seeds 0..n-1 (SEEDS), on the test
split, measuring every head every epoch. Each run is kept under --out/runs/ as it finishes, so
an interrupted run resumes where it stopped; results do not depend on --jobs.

Writes into --out: lr_choice.csv, tuning.csv, epochs.csv, results.md, summary.json, two plots
per task (<task>-lambda.png: the lambda sweep of the fused reading; <task>-readings.png: every
reading at lambda = 10, the exact and the advised arms) and escape.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
import stats2  # noqa: E402
from train import ARMS2, ESCAPE_LR, run, task_config  # noqa: E402

TASKS = ("vision", "shapes", "language")
# Learning-rate grids (the round-one baselines' choices in the middle) and seeds: 10 seeds where
# a run takes well under a minute, 5 for language, whose 16 arms x 10 seeds would take the task
# past its 30 minutes.
TUNE_LRS = {"vision": (3e-4, 1e-3, 3e-3), "shapes": (3e-4, 1e-3, 3e-3),
            "language": (1e-3, 3e-3, 1e-2)}
SEEDS = {"vision": 10, "shapes": 10, "language": 5}
TUNE_SEED = 100  # not among the evaluation seeds

EPOCH_COLUMNS = report.EPOCH_COLUMNS[:4] + ("lr",) + report.EPOCH_COLUMNS[4:] + (
    "steps", "W_norm", "W_move", "advised_lambda", "advised_placement")


def _key(phase, task, arm, seed, lr):
    return f"{phase}_{task}_{arm}_s{seed}_lr{lr:g}"


def _job(args):
    phase, task, arm, seed, lr, quick, path = args
    t = time.perf_counter()
    r = run(task, arm, seed, quick=quick, lr=lr, measure=phase == "main",
            split="valid" if phase == "tune" else "test")
    r["wall_seconds"] = time.perf_counter() - t
    r["rows"] = report.epoch_rows(r) if phase == "main" else r["epochs"]
    for row, e in zip(r["rows"], r["epochs"]):
        row.update(lr=e["lr"], steps=e["steps"], W_norm=e["W_norm"], W_move=e["W_move"])
    del r["records"]  # the aggregates per epoch are kept; the head records are not committed
    for row in r["rows"]:
        a = r.get("advice") or {}
        row["advised_lambda"] = a.get("lam", float("nan"))
        row["advised_placement"] = a.get("placement", "")
    report.write_atomic(path, json.dumps(report.json_value_tree(r)) + "\n")
    return args, r["wall_seconds"]


def _load(path):
    with open(path) as f:
        r = json.load(f)
    for row in r["rows"]:
        for k, v in row.items():
            if v == "inf":
                row[k] = math.inf
            elif v == "-inf":
                row[k] = -math.inf
            elif v is None:
                row[k] = math.nan
    return r


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, one seed, two learning rates: checks the pipeline")
    p.add_argument("--out", default=None,
                   help="output folder (default experiments/out-round2 or out-round2-quick)")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of: "
                   + ", ".join(TASKS))
    p.add_argument("--arms", default=",".join(ARMS2), help="comma-separated, of: "
                   + ", ".join(ARMS2))
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per task (default: vision 10, shapes 10, language 5; quick 1)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="the first seed (default 0): a rerun with other seeds starts elsewhere")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="parallel single-threaded runs (default min(2, cores))")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.arms = [x for x in a.arms.split(",") if x]
    for t in a.tasks:
        if t not in TASKS:
            p.error(f"--tasks: unknown task {t!r} (expected one of {', '.join(TASKS)})")
    for x in a.arms:
        if x not in ARMS2:
            p.error(f"--arms: unknown arm {x!r} (expected one of {', '.join(ARMS2)})")
    if "baseline" not in a.arms:
        p.error("--arms: the baseline is needed for the differences")
    if a.jobs < 1:
        p.error("--jobs: expected at least 1")
    if a.seeds is not None and a.seeds < 1:
        p.error("--seeds: expected at least 1")
    if a.first_seed < 0 or a.first_seed + (a.seeds or 10) > TUNE_SEED:
        p.error(f"--first-seed: expected 0 to {TUNE_SEED - (a.seeds or 10)} (the tuning seed "
                f"{TUNE_SEED} is not an evaluation seed)")
    if a.out is None:
        a.out = os.path.join(HERE, "out-round2-quick" if a.quick else "out-round2")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out: {a.out} exists and is not a folder")
    return a


def _execute(jobs, a, label, start):
    """Runs the jobs not already kept under runs/, longest first, and reports progress."""
    todo = [j for j in jobs if not os.path.exists(j[-1])]
    cost = {"language": 3, "shapes": 1, "vision": 1}
    todo.sort(key=lambda j: -(cost[j[1]] * (2 if ARMS2[j[2]].escape else 1)))
    progress = not a.quiet and sys.stderr.isatty()
    if not todo:
        return
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_job, j) for j in todo]
        for k, f in enumerate(cf.as_completed(futures), 1):
            j, wall = f.result()
            if progress:
                print(f"\r{label} [{k}/{len(todo)}] {j[1]} {j[2]} seed {j[3]} lr {j[4]:g} "
                      f"({wall:.0f} s, {time.perf_counter() - start:.0f} s in all)\033[K",
                      end="" if k < len(todo) else "\n", file=sys.stderr)


def main(argv=None) -> int:
    a = _parse(argv)
    runs = os.path.join(a.out, "runs")
    os.makedirs(runs, exist_ok=True)
    start = time.perf_counter()
    seeds = {t: a.seeds or (1 if a.quick else SEEDS[t]) for t in a.tasks}
    grid = {t: TUNE_LRS[t][:2] if a.quick else TUNE_LRS[t] for t in a.tasks}
    tuned_arms = [x for x in a.arms if not ARMS2[x].escape]

    # Phase 1: the learning rate of every arm, on the validation split.
    tune = [("tune", t, x, TUNE_SEED, lr, a.quick,
             os.path.join(runs, _key("tune", t, x, TUNE_SEED, lr) + ".json"))
            for t in a.tasks for x in tuned_arms for lr in grid[t]]
    _execute(tune, a, "tuning", start)
    tuning_rows, choice, task_seconds = [], {}, {}
    for t in a.tasks:
        m = report.metric_of(t)
        better = max if m == "test_accuracy" else min
        for x in tuned_arms:
            scores = {}
            for lr in grid[t]:
                r = _load(os.path.join(runs, _key("tune", t, x, TUNE_SEED, lr) + ".json"))
                last = r["rows"][-1]
                v = last[m] if not r["diverged"] else (-math.inf if m == "test_accuracy"
                                                         else math.inf)
                scores[lr] = v
                task_seconds[t] = task_seconds.get(t, 0.0) + r["wall_seconds"]
                tuning_rows.append(dict(task=t, arm=x, lr=lr, seed=TUNE_SEED,
                                        epochs=last["epoch"], valid_metric=m.replace("test", "valid"),
                                        valid_value=v, diverged=r["diverged"],
                                        seconds=r["wall_seconds"]))
            # The best final validation metric; a tie goes to the smaller learning rate.
            best = better(scores.values())
            choice[(t, x)] = min(lr for lr, v in scores.items() if v == best)
        for x in a.arms:
            if ARMS2[x].escape:
                choice[(t, x)] = ESCAPE_LR
    report.write_csv(os.path.join(a.out, "tuning.csv"), tuning_rows,
                     ("task", "arm", "lr", "seed", "epochs", "valid_metric", "valid_value",
                      "diverged", "seconds"))
    report.write_csv(os.path.join(a.out, "lr_choice.csv"),
                     [dict(task=t, arm=x, lr=choice[(t, x)]) for t in a.tasks for x in a.arms],
                     ("task", "arm", "lr"))

    # Phase 2: every arm at its learning rate, on the test split, measured every epoch.
    main_jobs = [("main", t, x, s, choice[(t, x)], a.quick,
                  os.path.join(runs, _key("main", t, x, s, choice[(t, x)]) + ".json"))
                 for t in a.tasks for x in a.arms
                 for s in range(a.first_seed, a.first_seed + seeds[t])]
    _execute(main_jobs, a, "runs", start)
    rows, walls, advice, diverged = [], {}, [], []
    for j in main_jobs:
        r = _load(j[-1])
        rows += r["rows"]
        walls.setdefault((j[1], j[2]), []).append(r["wall_seconds"])
        task_seconds[j[1]] = task_seconds.get(j[1], 0.0) + r["wall_seconds"]
        if r.get("advice"):
            advice.append(dict(task=j[1], seed=j[3], **r["advice"]))
        if r["diverged"]:
            diverged.append([j[1], j[2], j[3]])
    report.write_csv(os.path.join(a.out, "epochs.csv"), rows, EPOCH_COLUMNS)
    text = stats2.results_markdown(rows, a.arms, advice)
    report.write_atomic(os.path.join(a.out, "results.md"), text)
    # Two figures per task (fifteen arms do not read in one): the lambda sweep of the fused
    # reading, and every reading at lambda = 10 with the exact and advised arms; and the escape
    # arm's movement and saturation.
    sweep = [x for x in a.arms if x == "baseline" or (ARMS2[x].method == "lambda"
                                                      and ARMS2[x].placement == "fused"
                                                      and not ARMS2[x].escape)]
    readings = [x for x in a.arms if x not in sweep or x in ("baseline", "lambda10_fused")]
    readings = [x for x in readings if not ARMS2[x].escape]
    for t in a.tasks:
        report.plot(rows, sweep, t, os.path.join(a.out, f"{t}-lambda.png"))
        report.plot(rows, readings, t, os.path.join(a.out, f"{t}-readings.png"))
    if any(ARMS2[x].escape for x in a.arms):
        stats2.plot_escape(rows, [x for x in a.arms if ARMS2[x].escape], a.tasks,
                           os.path.join(a.out, "escape.png"))
    wall = time.perf_counter() - start
    import numpy
    import torch

    import spectral_cond

    meta = dict(
        command="experiments/round2.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        quick=a.quick,
        seeds={t: list(range(a.first_seed, a.first_seed + n)) for t, n in seeds.items()},
        arms={x: ARMS2[x].__dict__ for x in a.arms},
        tasks={t: task_config(t, a.quick).__dict__ for t in a.tasks},
        tune_lrs=grid, tune_seed=TUNE_SEED, escape_lr=ESCAPE_LR,
        lr_choice=[dict(task=t, arm=x, lr=choice[(t, x)]) for t in a.tasks for x in a.arms],
        advice=advice, diverged=diverged,
        seconds_per_run={f"{t} {x}": sum(v) / len(v) for (t, x), v in walls.items()},
        wall_seconds_this_invocation=wall, jobs=a.jobs, threads_per_run=1,
        # Every kept run's own wall time (tuning and evaluation), summed per task: over --jobs,
        # about the task's share of the wall time of an uninterrupted run.
        run_seconds_per_task=task_seconds,
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      numpy=numpy.__version__, spectral_cond=spectral_cond.__version__),
        machine=dict(cores=os.cpu_count(), platform=platform.platform()),
        stats=stats2.summary_tree(rows, a.arms))
    report.write_atomic(os.path.join(a.out, "summary.json"),
                         json.dumps(report.json_value_tree(meta), indent=1) + "\n")
    print(text)
    print(f"round2.py: {len(tune)} tuning and {len(main_jobs)} runs, {wall:.0f} s in this "
          f"invocation, written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
