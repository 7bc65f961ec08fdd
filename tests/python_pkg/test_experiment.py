"""The training experiment's quick mode (experiments/run.py --quick, docs/reproduction.md): it
runs every arm of both tasks, writes well-formed CSV, JSON lines, a table and plots, every
kappa(J) it logs agrees with a dense SVD of J (built by torch.func.jacrev from the X and weights
the run saved by its own hooks) within the accuracy it states, the proven bound holds, and a
rerun with another number of processes reproduces the numbers."""

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import EPS, torch_jacobian

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = os.path.join(ROOT, "experiments", "run.py")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import report  # noqa: E402
from train import ARMS, task_config  # noqa: E402

TIMING = {"train_seconds", "measure_seconds", "seconds"}


def _run(out, *extra):
    p = subprocess.run([sys.executable, RUN, "--quick", "--out", str(out), "--quiet", *extra],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    return p


def _csv(path):
    with open(path, newline="") as f:
        r = csv.DictReader(f)
        return r.fieldnames, list(r)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    p = _run(out, "--dump-probes", "--jobs", "1")
    return out, p


def test_quick_writes_every_output(quick):
    out, p = quick
    for name in ("measurements.jsonl", "heads.csv", "epochs.csv", "summary.json", "results.md",
                 "vision.png", "language.png"):
        assert (out / name).stat().st_size > 0, name
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]
    for t in ("vision", "language"):
        with open(out / f"{t}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image

        img = matplotlib.image.imread(str(out / f"{t}.png"))
        assert img.shape[0] > 300 and img.shape[1] > 600
    cols, rows = _csv(out / "epochs.csv")
    assert tuple(cols) == report.EPOCH_COLUMNS
    # 2 tasks x 5 arms x 1 seed x (epoch 0 and epoch 1).
    assert len(rows) == 2 * len(ARMS) * 2
    assert {(r["task"], r["arm"]) for r in rows} == {(t, a) for t in ("vision", "language")
                                                      for a in ARMS}
    text = {"task", "arm", "methods", "free_bound_holds"}
    for r in rows:
        for k, v in r.items():
            if k not in text and v != "":
                float(v)  # every other cell is a number (inf allowed), or empty for NaN
        assert r["free_bound_holds"] == "true"
        assert r["not_success"] == "0"
        assert r["test_loss"] != ""
        if r["task"] == "vision":
            assert 0 <= float(r["test_accuracy"]) <= 1
    hcols, heads = _csv(out / "heads.csv")
    assert tuple(hcols) == report.HEAD_COLUMNS
    per_run = {t: task_config(t, quick=True) for t in ("vision", "language")}
    assert len(heads) == sum(2 * len(ARMS) * c.depth * c.heads for c in per_run.values())
    with open(out / "measurements.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert {r["kind"] for r in recs} == {"layer", "head"}
    assert sum(r["kind"] == "head" for r in recs) == len(heads)
    s = json.load(open(out / "summary.json"))
    assert s["quick"] is True and s["seeds"] == [0] and s["diverged"] == []
    assert len(s["summary"]) == 2 * len(ARMS)
    md = (out / "results.md").read_text()
    # each arm once per task in the results table, and once more in the paired table
    for a in ARMS:
        assert md.count(f"| {a} |") == (2 if a == "baseline" else 4)
    assert md.count("paired by seed") == 2
    assert p.stdout.strip() == md.strip()


def test_every_logged_kappa_J_agrees_with_a_dense_svd(quick):
    out, _ = quick
    _, heads = _csv(out / "heads.csv")
    checked = 0
    for h in heads:
        z = np.load(out / "probes" / f"{h['task']}_{h['arm']}_s{h['seed']}_e{h['epoch']}.npz")
        layer, head = int(h["layer"]), int(h["head"])
        X, W = z[f"X{layer}"], z[f"W{layer}"]
        heads_n = int(z["heads"][layer])
        D = X.shape[1]
        d = D // heads_n
        blocks = [W[i * D:(i + 1) * D].T[:, head * d:(head + 1) * d] for i in range(3)]
        J = torch_jacobian(X, *blocks, causal=bool(z["causal"][layer]))
        sv = np.linalg.svd(J, compute_uv=False)
        assert J.shape[0] <= J.shape[1]
        kappa_ref = sv[0] / sv[-1]
        acc = float(h["accuracy"])
        assert h["info"] == "success" and math.isfinite(acc) and acc < 1e-3
        # Tolerance: the accuracy the run states, plus the dense reference's own error
        # (about eps kappa sqrt(n) relative on sigma_min).
        tol = acc + 64 * EPS * kappa_ref * math.sqrt(J.shape[0])
        assert float(h["sigma_max_J"]) == pytest.approx(sv[0], rel=64 * EPS * J.shape[0])
        assert float(h["sigma_min_J"]) == pytest.approx(sv[-1], rel=tol), h
        assert float(h["kappa_J"]) == pytest.approx(kappa_ref, rel=2 * tol), h
        if h["free_bound"] != "":
            assert kappa_ref <= float(h["free_bound"]) * (1 + tol)
        checked += 1
    assert checked == len(heads) > 0


def test_rerun_reproduces_the_numbers(quick, tmp_path):
    out, _ = quick
    _run(tmp_path, "--tasks", "vision,language", "--arms", "baseline,lambda10_fused",
         "--jobs", "2")
    _, first = _csv(out / "epochs.csv")
    _, again = _csv(tmp_path / "epochs.csv")
    pick = {(r["task"], r["arm"], r["epoch"]): r for r in first}
    assert len(again) == 2 * 2 * 2
    for r in again:
        ref = pick[(r["task"], r["arm"], r["epoch"])]
        for k, v in r.items():
            if k not in TIMING:
                assert v == ref[k], (k, r["task"], r["arm"], r["epoch"])


def test_bad_arguments_are_refused(tmp_path):
    for args, word in ((["--arms", "nope"], "--arms"), (["--tasks", "audio"], "--tasks"),
                       (["--seeds", "0"], "--seeds"), (["--arms", "lambda10_fused"], "baseline")):
        p = subprocess.run([sys.executable, RUN, "--quick", "--out", str(tmp_path), *args],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and word in p.stderr, (args, p.stderr)
    f = tmp_path / "file"
    f.write_text("keep")
    p = subprocess.run([sys.executable, RUN, "--quick", "--out", str(f)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--out" in p.stderr and f.read_text() == "keep"


def _head(layer, head, kappa, smin, smax, info, free_bound):
    return dict(kind="head", epoch=0, layer=layer, head=head, kappa_J=kappa, sigma_min_J=smin,
                sigma_max_J=smax, info=info, free_bound=free_bound, accuracy=1e-12,
                method="dense", row_max_mean=0.5, entropy_mean=1.0, saturated_fraction=0.0,
                ratio_QK_V=1.0, collapsed=False, kappa_WQ=1.0, kappa_WK=1.0, kappa_WV=1.0)


def test_layer_kappa_of_a_singular_head_is_inf_and_vacuous_bounds_are_counted():
    """A layer holding a singular head (sigma_min rounded to 1e-30, not 0) is +inf, never the
    finite sigma_max/sigma_min; an infinite bound is counted as vacuous, apart from 'holds'."""
    result = {"epochs": [{"epoch": 0, "task": "vision", "arm": "a", "seed": 0}],
              "records": [_head(0, 0, 3.0, 1.0, 3.0, "success", 10.0),
                          _head(0, 1, math.inf, 1e-30, 2.0, "singular", math.inf),
                          _head(1, 0, 4.0, 0.5, 2.0, "success", 8.0),
                          _head(1, 1, 2.0, 1.0, 2.0, "success", 5.0)]}
    (row,) = report.epoch_rows(result)
    assert row["kappa_J_layer_max"] == math.inf
    assert row["kappa_J_layer_median"] == math.inf  # layers: +inf and 2.0/0.5 = 4
    assert row["free_bound_vacuous"] == 1
    assert row["free_bound_holds"] is True


def test_the_documents_counts_are_the_committed_files():
    """The counts docs/reproduction.md states of its committed run equal what
    docs/reproduction/epochs.csv holds (recomputed here): head measurements per task, the singular
    ones in all and in the lambda = 10 arms, and the lambda = 10 epoch rows whose bound without
    hypothesis is +inf (vacuous)."""
    import re

    with open(os.path.join(ROOT, "docs", "reproduction.md")) as f:
        text = " ".join(f.read().split())
    _, rows = _csv(os.path.join(ROOT, "docs", "reproduction", "epochs.csv"))
    measured = [r for r in rows if r["kappa_J_median"] != ""]

    def num(s):
        return int(s.replace(",", ""))

    m = re.search(r"Of ([\d,]+) head measurements \(vision: ([\d,]+) epoch rows of (\d+) heads, "
                  r"([\d,]+); language: ([\d,]+) of (\d+), ([\d,]+)\) ([\d,]+) are `singular`, all "
                  r"but (\d+) in the λ = 10 arms \(vision: ([\d,]+) of ([\d,]+); language: "
                  r"([\d,]+) of ([\d,]+)\)", text)
    assert m, "the sentence with the counts of head measurements is not in the document"
    (total, v_rows, v_heads, v_meas, l_rows, l_heads, l_meas, singular, outside, v_sing10,
     v_meas10, l_sing10, l_meas10) = (num(g) for g in m.groups())
    per_task = {"vision": (v_rows, v_heads, v_meas, v_sing10, v_meas10),
                "language": (l_rows, l_heads, l_meas, l_sing10, l_meas10)}
    for task, (n_rows, heads, meas, sing10, meas10) in per_task.items():
        mine = [r for r in measured if r["task"] == task]
        ten = [r for r in mine if r["arm"].startswith("lambda10")]
        assert len(mine) == n_rows and n_rows * heads == meas, task
        assert len(ten) * heads == meas10, task
        assert sum(int(r["not_success"]) for r in ten) == sing10, task
    assert total == v_meas + l_meas
    all_singular = sum(int(r["not_success"]) for r in measured)
    assert all_singular == singular
    assert singular - v_sing10 - l_sing10 == outside

    m = re.search(r"in ([\d,]+) of the ([\d,]+) λ = 10 epoch rows its median over heads is \+inf",
                  text)
    assert m, "the sentence with the vacuous bounds is not in the document"
    ten = [r for r in measured if r["arm"].startswith("lambda10")]
    assert num(m.group(2)) == len(ten)
    assert num(m.group(1)) == sum(1 for r in ten if float(r["free_bound_median"]) == math.inf)


def test_no_finite_kappa_above_1e16_in_the_committed_tables():
    """The project's rule in every committed CSV of docs/reproduction/: a kappa that is not
    +inf is one with a correct digit, so none above 1e16 (a layer holding a singular head is
    +inf, not sigma_max over a rounded sigma_min)."""
    import glob

    files = glob.glob(os.path.join(ROOT, "docs", "reproduction", "**", "*.csv"), recursive=True)
    assert files
    for path in files:
        _, rows = _csv(path)
        for i, r in enumerate(rows):
            for k, v in r.items():
                if "kappa" not in k or v in ("", None):
                    continue
                try:
                    x = float(v)
                except ValueError:
                    continue
                assert not (math.isfinite(x) and x > 1e16), f"{os.path.basename(path)} row {i} {k} = {v}"
