#!/usr/bin/env python3
"""Trains small transformers with and without spectral conditioning and measures kappa(J) all
the way (docs/reproduction.md).

  .venv-py/bin/python experiments/run.py                 the full run: both tasks, 5 arms, 5 seeds
  .venv-py/bin/python experiments/run.py --quick         one seed, one epoch, tiny sizes
  .venv-py/bin/python experiments/run.py --tune          the baseline's learning-rate choice

Writes into --out: measurements.jsonl (every KappaMonitor record, with task, arm, seed, epoch),
heads.csv (one row per head and epoch), epochs.csv (one row per run and epoch: metrics and the
aggregates over heads), summary.json (configuration, data sources, the table's numbers, wall
time), results.md (the table) and <task>.png (the curves). Runs are single-threaded and spread
over --jobs processes; results do not depend on --jobs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # noqa: E402
from train import ARMS, run, task_config  # noqa: E402

TASKS = ("vision", "language")
TUNE_LRS = (3e-4, 1e-3, 3e-3, 1e-2)
TUNE_SEEDS = (100, 101)  # not among the evaluation seeds


def _job(args):
    task, arm, seed, quick, lr, measure, dump = args
    t = time.perf_counter()
    r = run(task, arm, seed, quick=quick, lr=lr, measure=measure, dump_dir=dump)
    r["wall_seconds"] = time.perf_counter() - t
    return (task, arm, seed, lr), r


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one seed, one epoch, tiny sizes: checks the pipeline in seconds")
    p.add_argument("--tune", action="store_true",
                   help="the baseline only, learning rates %s, seeds %s, no kappa measurement"
                        % (", ".join(map(str, TUNE_LRS)), ", ".join(map(str, TUNE_SEEDS))))
    p.add_argument("--out", default=None,
                   help="output folder (default experiments/out, experiments/out-quick or "
                        "experiments/out-tune)")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: vision,language")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..n-1 (default 5; quick 1)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="parallel single-threaded runs (default min(2, cores))")
    p.add_argument("--dump-probes", action="store_true",
                   help="also save each measurement's X and qkv weights under probes/ (for the "
                        "test that checks kappa(J) against a dense SVD)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.arms = [x for x in a.arms.split(",") if x]
    for t in a.tasks:
        if t not in TASKS:
            p.error(f"--tasks: unknown task {t!r} (expected vision, language)")
    for x in a.arms:
        if x not in ARMS:
            p.error(f"--arms: unknown arm {x!r} (expected one of {', '.join(ARMS)})")
    if "baseline" not in a.arms and not a.tune:
        p.error("--arms: the baseline is needed for the differences")
    if a.seeds is None:
        a.seeds = 1 if a.quick else 5
    if a.seeds < 1:
        p.error("--seeds: expected at least 1")
    if a.jobs < 1:
        p.error("--jobs: expected at least 1")
    if a.quick and a.tune:
        p.error("--quick and --tune exclude each other")
    if a.out is None:
        a.out = os.path.join(HERE, "out-quick" if a.quick else "out-tune" if a.tune else "out")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out: {a.out} exists and is not a folder")
    return a


def main(argv=None) -> int:
    a = _parse(argv)
    os.makedirs(a.out, exist_ok=True)
    dump = None
    if a.dump_probes:
        dump = os.path.join(a.out, "probes")
        os.makedirs(dump, exist_ok=True)
    if a.tune:
        jobs = [(t, "baseline", s, False, lr, False, None)
                for t in a.tasks for lr in TUNE_LRS for s in TUNE_SEEDS]
    else:
        jobs = [(t, arm, s, a.quick, None, True, dump)
                for t in a.tasks for arm in a.arms for s in range(a.seeds)]
    progress = not a.quiet and sys.stderr.isatty()
    start = time.perf_counter()
    results = {}
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_job, j) for j in jobs]
        for k, f in enumerate(cf.as_completed(futures), 1):
            key, r = f.result()
            results[key] = r
            if progress:
                last = r["epochs"][-1]
                m = report.metric_of(key[0])
                print(f"\r[{k}/{len(jobs)}] {key[0]} {key[1]} seed {key[2]}: {m} "
                      f"{last[m]:.4f} ({r['wall_seconds']:.0f} s, {time.perf_counter() - start:.0f}"
                      f" s in all)\033[K", end="" if k < len(jobs) else "\n", file=sys.stderr)
    wall = time.perf_counter() - start
    order = sorted(results, key=lambda k: (TASKS.index(k[0]), list(ARMS).index(k[1]), k[2],
                                           k[3] or 0))
    if a.tune:
        return _write_tuning(a, results, order, wall)
    rows, records = [], []
    for key in order:
        rows += report.epoch_rows(results[key])
        records += results[key]["records"]
    heads = [r for r in records if r["kind"] == "head"]
    report.write_jsonl(os.path.join(a.out, "measurements.jsonl"), records)
    report.write_csv(os.path.join(a.out, "heads.csv"), heads, report.HEAD_COLUMNS)
    report.write_csv(os.path.join(a.out, "epochs.csv"), rows, report.EPOCH_COLUMNS)
    summ = report.summary(rows, a.arms)
    table = report.markdown_table(summ) + "\n" + report.paired_table(rows, a.arms)
    report.write_atomic(os.path.join(a.out, "results.md"), table)
    for t in a.tasks:
        report.plot(rows, a.arms, t, os.path.join(a.out, f"{t}.png"))
    import numpy
    import torch

    import spectral_cond

    meta = dict(
        command="experiments/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        quick=a.quick, seeds=list(range(a.seeds)), arms={k: ARMS[k] for k in a.arms},
        tasks={t: task_config(t, a.quick).__dict__ for t in a.tasks},
        sources={t: next(r["source"] for k, r in results.items() if k[0] == t) for t in a.tasks},
        diverged=[list(k[:3]) for k, r in results.items() if r["diverged"]],
        wall_seconds=wall, jobs=a.jobs, threads_per_run=1,
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      numpy=numpy.__version__, spectral_cond=spectral_cond.__version__),
        machine=dict(cores=os.cpu_count(), platform=platform.platform()),
        summary=summ)
    report.write_atomic(os.path.join(a.out, "summary.json"),
                         json.dumps(report.json_value_tree(meta), indent=1) + "\n")
    print(table)
    print(f"run.py: {len(jobs)} runs in {wall:.0f} s, written to {a.out}", file=sys.stderr)
    return 0


def _write_tuning(a, results, order, wall) -> int:
    rows = []
    for key in order:
        last = results[key]["epochs"][-1]
        rows.append(dict(task=key[0], lr=key[3], seed=key[2], epochs=last["epoch"],
                         test_accuracy=last["test_accuracy"], test_loss=last["test_loss"],
                         diverged=results[key]["diverged"]))
    report.write_csv(os.path.join(a.out, "tuning.csv"), rows,
                     ("task", "lr", "seed", "epochs", "test_accuracy", "test_loss", "diverged"))
    for t in a.tasks:
        m = report.metric_of(t)
        for lr in TUNE_LRS:
            v = [r[m] for r in rows if r["task"] == t and r["lr"] == lr]
            print(f"{t} lr {lr:g}: {m} " + " ".join(f"{x:.4f}" for x in v))
    print(f"run.py --tune: {len(rows)} runs in {wall:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
