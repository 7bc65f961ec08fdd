"""The second round of the training experiment (experiments/round2.py, docs/reproduction.md):
the generated shapes task makes no network call and is what it says, the validation splits are
carved from the training data, Holm's adjustment, and the pipeline on a small subset: the
learning rate of every arm is the best of its tuning runs on the validation split, the escape
arm trains twice as long at its own rate, the advisor's choice is recorded, and a second
invocation reuses every kept run and writes the same tables."""

import csv
import math
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ROUND2 = os.path.join(ROOT, "experiments", "round2.py")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import data  # noqa: E402
import stats2  # noqa: E402
from train import ADVISE_LAMBDAS, ESCAPE_LR, task_config  # noqa: E402


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_shapes_is_generated_without_any_network_call(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the shapes task tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    a, b = data.shapes(), data.shapes()
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert a.train_x.shape == (1600, 8, 8) and a.test_x.shape == (800, 8, 8)
    assert float(a.train_x.min()) >= 0 and float(a.train_x.max()) <= 1
    assert torch.bincount(a.train_y).tolist() == [200] * len(data.SHAPES)
    # Train and test come from different generators: no test image is a training image.
    tr = {bytes(x.numpy().tobytes()) for x in a.train_x}
    assert not any(bytes(x.numpy().tobytes()) in tr for x in a.test_x)
    assert not torch.equal(data.shapes(seed=1).train_x, a.train_x)


@pytest.mark.parametrize("kind", range(8))
def test_each_shape_draws_its_pattern(kind):
    rng = np.random.default_rng(kind)
    for _ in range(20):
        img = data._shape(kind, rng, 8) > 0
        rows, cols = np.nonzero(img)
        h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        n = max(h, w)
        assert 3 <= n <= 6
        expected = {0: n, 1: n, 2: n, 3: n, 4: 4 * n - 4, 5: n * n,
                    6: 2 * n - 1, 7: 2 * n - (n % 2)}[kind]
        assert img.sum() == expected, (kind, img.astype(int))
        if kind == 0:
            assert h == 1
        if kind == 1:
            assert w == 1
        if kind in (2, 3, 5, 4, 7):
            assert h == w
        if kind == 2:
            assert all(img[rows.min() + k, cols.min() + k] for k in range(n))
        if kind == 3:
            assert all(img[rows.min() + k, cols.max() - k] for k in range(n))


def test_validation_splits_are_carved_from_the_training_data():
    d = data.shapes(400, 200)
    v = data.validation_split(d, fraction=0.25, seed=3)
    assert len(v.train_y) + len(v.test_y) == len(d.train_y)
    assert torch.bincount(v.test_y).tolist() == [round(0.25 * 50)] * 8
    train = {x.numpy().tobytes() for x in d.train_x}
    test = {x.numpy().tobytes() for x in d.test_x}
    held = {x.numpy().tobytes() for x in v.test_x}
    kept = {x.numpy().tobytes() for x in v.train_x}
    assert held <= train and not (held & test) and not (held & kept)
    text = data.Corpus(torch.arange(100), torch.arange(100, 120), ["a"], "s", "h")
    cv = data.corpus_validation(text, 0.1)
    assert torch.equal(cv.train, torch.arange(90)) and torch.equal(cv.valid, torch.arange(90, 100))


def test_holm_by_hand():
    # Sorted p: 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04, raised to 0.06).
    got = stats2.holm([0.01, 0.04, 0.03, math.nan])
    assert got[:3] == pytest.approx([0.03, 0.06, 0.06]) and math.isnan(got[3])
    assert stats2.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])
    assert stats2.holm([]) == []


ARMS = "baseline,lambda10_packed,exact_refresh,advised,escape_lambda10"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("round2")
    cmd = [sys.executable, ROUND2, "--quick", "--tasks", "shapes", "--arms", ARMS, "--jobs", "1",
           "--out", str(out), "--quiet"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return out, cmd, p


def test_each_arm_gets_the_best_learning_rate_of_its_validation_runs(small):
    out, _, _ = small
    tuning = _csv(out / "tuning.csv")
    choice = {r["arm"]: float(r["lr"]) for r in _csv(out / "lr_choice.csv")}
    assert set(choice) == set(ARMS.split(","))
    assert all(r["valid_metric"] == "valid_accuracy" for r in tuning)
    assert "escape_lambda10" not in {r["arm"] for r in tuning}
    for arm in set(r["arm"] for r in tuning):
        rs = [r for r in tuning if r["arm"] == arm]
        best = max(float(r["valid_value"]) for r in rs)
        assert choice[arm] == min(float(r["lr"]) for r in rs if float(r["valid_value"]) == best)
    assert choice["escape_lambda10"] == ESCAPE_LR
    rows = _csv(out / "epochs.csv")
    for r in rows:
        assert float(r["lr"]) == choice[r["arm"]]


def test_the_runs_record_what_the_report_relies_on(small):
    out, _, _ = small
    rows = _csv(out / "epochs.csv")
    epochs = task_config("shapes", quick=True).epochs
    by_arm = {}
    for r in rows:
        by_arm.setdefault(r["arm"], []).append(r)
    assert max(int(r["epoch"]) for r in by_arm["escape_lambda10"]) == 2 * epochs
    assert max(int(r["epoch"]) for r in by_arm["baseline"]) == epochs
    for rs in by_arm.values():
        e0 = [r for r in rs if r["epoch"] == "0"][0]
        assert float(e0["W_move"]) == 0 and int(e0["steps"]) == 0 and float(e0["W_norm"]) > 0
        assert all(r["kappa_J_median"] != "" for r in rs)  # every epoch measured
    adv = by_arm["advised"][0]
    assert adv["advised_placement"] == "" or float(adv["advised_lambda"]) in ADVISE_LAMBDAS
    text = (out / "results.md").read_text()
    assert "Holm-corrected over the 4 arms" in text and "Escape arm" in text
    assert "Cost of refreshing" not in text  # exact_fused is not among the arms run


def test_a_second_invocation_reuses_the_kept_runs(small, tmp_path):
    out, cmd, _ = small
    before = {n: (out / n).read_bytes() for n in ("epochs.csv", "lr_choice.csv", "tuning.csv")}
    kept = sorted(os.listdir(out / "runs"))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(out / "runs")) == kept
    for n, b in before.items():
        assert (out / n).read_bytes() == b, n


def test_bad_arguments_are_refused(tmp_path):
    for args, msg in ((["--tasks", "audio"], "--tasks: unknown task 'audio'"),
                      (["--arms", "lambda10_fused"], "the baseline is needed"),
                      (["--arms", "baseline,magic"], "--arms: unknown arm 'magic'"),
                      (["--jobs", "0"], "--jobs: expected at least 1")):
        p = subprocess.run([sys.executable, ROUND2, "--out", str(tmp_path / "o"), *args],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_the_committed_tables_are_recomputed_from_the_committed_runs():
    """docs/reproduction/round2/results.md is what stats2 computes from the committed
    epochs.csv (and the advisor's choices in summary.json), and docs/reproduction.md quotes
    its every table row."""
    import json

    import rerun_check

    base = os.path.join(ROOT, "docs", "reproduction", "round2")
    rows = rerun_check.read_rows(os.path.join(base, "epochs.csv"))
    with open(os.path.join(base, "summary.json")) as f:
        meta = json.load(f)
    choice = {(c["task"], c["arm"]): c["lr"] for c in meta["lr_choice"]}
    text = stats2.results_markdown(rows, list(meta["arms"]), meta["advice"])
    with open(os.path.join(base, "results.md")) as f:
        committed = f.read()
    assert text == committed
    with open(os.path.join(ROOT, "docs", "reproduction.md")) as f:
        doc = f.read()
    table_rows = [ln for ln in committed.splitlines() if ln.startswith("| ")]
    assert len(table_rows) > 40
    for ln in table_rows:
        assert ln in doc, ln
    # Every lr in the runs is the committed choice, and the choice is the best of tuning.csv.
    for r in rows:
        assert r["lr"] == choice[(r["task"], r["arm"])]
    tuning = _csv(os.path.join(base, "tuning.csv"))
    for (task, arm), lr in choice.items():
        rs = [t for t in tuning if t["task"] == task and t["arm"] == arm]
        if not rs:
            assert arm.startswith("escape") and lr == ESCAPE_LR
            continue
        vals = {float(t["lr"]): float(t["valid_value"]) for t in rs}
        best = (max if task != "language" else min)(vals.values())
        assert lr == min(x for x, v in vals.items() if v == best), (task, arm)


def test_the_rerun_with_other_seeds_is_recomputed_and_agrees():
    """rerun-other-seeds.md is what stats2.direction_check computes from the two committed
    CSVs, and every claim it could rerun agrees in direction (the document says so)."""
    import rerun_check
    from train import ARMS2

    base = os.path.join(ROOT, "docs", "reproduction", "round2")
    rows = rerun_check.read_rows(os.path.join(base, "epochs.csv"))
    other = rerun_check.read_rows(os.path.join(base, "epochs-other-seeds.csv"))
    assert {int(r["seed"]) for r in other}.isdisjoint({int(r["seed"]) for r in rows})
    text = stats2.direction_check(rows, other, list(ARMS2))
    with open(os.path.join(base, "rerun-other-seeds.md")) as f:
        assert f.read() == text
    with open(os.path.join(ROOT, "docs", "reproduction.md")) as f:
        doc = " ".join(f.read().split())
    agree, total = (int(x) for x in
                    __import__("re").search(r"(\d+) of (\d+) rerun claims agree", text).groups())
    assert f"{agree} of {total} rerun claims agree in direction" in doc
