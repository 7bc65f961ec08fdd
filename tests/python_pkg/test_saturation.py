"""experiments/saturation.py --quick (docs/reproduction.md, "Saturation at real shapes"): the
attention pattern it measures reproduces each module's own output, its count of saturated rows
agrees with the library's, kappa(J) of its sampled heads agrees with a dense SVD of J from
torch.func.jacrev, and the readings behave as MATH.md §7 says they must: lambda = 0 is one model
under every placement, the packed identity of a D x 3D weight with D = heads d reaches W_Q alone
(the same numbers as fused:q), and adding lambda I to W_V alone leaves the pattern unchanged."""

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "experiments", "saturation.py")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("saturation")
    p = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(out), "--quiet",
                        "--lambdas", "0,0.5,2,10", "--kappa", "--kappa-lambdas", "0,2",
                        "--kappa-shapes", "vit,gpt2", "--kappa-heads", "2"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    with open(out / "saturation.json") as f:
        return out, json.load(f)


def rows_of(doc, shape, placement):
    s = next(s for s in doc["shapes"] if s["shape"] == shape)
    return [r for r in s["rows"] if r["placement"] == placement]


def test_outputs_and_checks(quick):
    out, doc = quick
    for name in ("saturation.json", "saturation.csv", "saturation.png", "saturation.txt"):
        assert (out / name).stat().st_size > 0
    with open(out / "saturation.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    n = sum(len(s["rows"]) for s in doc["shapes"])
    assert len(csv_rows) == n
    assert {s["shape"] for s in doc["shapes"]} == {"vit", "gpt2"}
    for s in doc["shapes"]:
        for r in s["rows"]:
            # P V of the float64 pattern against the float32 module's own output
            assert r["pattern_check"] < 1e-4, r
            assert r["library_check"] == 0, r
            assert 0 <= r["saturated_fraction"] <= 1
            for k in r["kappa_J"]:
                assert k["info"] in ("success", "singular"), k


def test_readings_behave_as_the_math_says(quick):
    _, doc = quick
    keys = ("saturated_fraction", "entropy", "grad_WQ", "grad_WK", "cls_self_attention")
    for shape in ("vit", "gpt2"):
        base = {r["layer"]: r for r in rows_of(doc, shape, "fused") if r["lam"] == 0}
        for placement in doc["config"]["placements"]:
            for r in rows_of(doc, shape, placement):
                if r["lam"] == 0:
                    for k in keys:
                        assert r[k] == base[r["layer"]][k], (shape, placement, k)
        # D = heads d in both quick shapes: the packed identity is W_Q's alone
        packed, q_only = rows_of(doc, shape, "packed"), rows_of(doc, shape, "fused:q")
        assert len(packed) == len(q_only)
        for a, b in zip(packed, q_only):
            assert (a["lam"], a["layer"]) == (b["lam"], b["layer"])
            assert a["saturated_fraction"] == b["saturated_fraction"]
            assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-12, abs=1e-12)
        # lambda I on W_V alone changes values, never the pattern (layer 0 reads the same X)
        for r in rows_of(doc, shape, "fused:v"):
            if r["layer"] == 0:
                assert r["entropy"] == pytest.approx(base[0]["entropy"], rel=1e-9)
        # the fused reading saturates more rows at lambda = 10 than at 0
        f = rows_of(doc, shape, "fused")
        top = np.mean([r["saturated_fraction"] for r in f if r["lam"] == 10])
        assert top > np.mean([r["saturated_fraction"] for r in f if r["lam"] == 0])


def test_kappa_of_sampled_heads_against_jacrev(quick, tmp_path):
    """The script's kappa(J) of a sampled head, recomputed: the quick ViT rebuilt with the same
    seed, layer 0's input captured, J by torch.func.jacrev in float64, numpy's SVD."""
    import torch
    from conftest import torch_jacobian

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import saturation

    import spectral_cond.torch as sct

    _, doc = quick
    s = next(s for s in doc["shapes"] if s["shape"] == "vit")
    row = next(r for r in s["rows"] if r["placement"] == "fused" and r["lam"] == 2 and
               r["layer"] == 0)
    assert row["kappa_J"], "no kappa(J) for the sampled heads"
    # The script's float32 model, whatever default dtype another test module left behind.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model, cfg = saturation.vit(quick=True)
    finally:
        torch.set_default_dtype(default)
    sct.spectral_conditioning(model, method="lambda", lam=2.0, placement="fused")
    site = sct.find_attention(model)[0]
    cap = saturation.Capture([site])
    with torch.no_grad():
        model(saturation.sample_crops(cfg["img_size"], 1))
    cap.close()
    X = cap.x[0][0].numpy()
    for k in row["kappa_J"]:
        (wq, bq), (wk, bk), (wv, bv) = saturation.head_weights(site, k["head"])
        J = torch_jacobian(X, wq, wk, wv, scale=1 / math.sqrt(wq.shape[1]),
                           biases=(bq, bk, bv))
        sv = np.linalg.svd(J, compute_uv=False)
        ref = sv[0] / sv[-1]
        assert abs(k["kappa"] - ref) <= (k["accuracy"] + 1e-10) * ref, (k, ref)
