"""spectral_cond.analyze: the tool's analyze of a checkpoint on disk, against numpy SVDs of the
same weights (tests/data/pytorch: a legacy-format BERT-named checkpoint written by torch.save)."""
import json
import os

import numpy as np
import pytest

import spectral_cond as sc

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "pytorch")
RTOL = 1e-10


def kap(W):
    s = np.linalg.svd(W, compute_uv=False)
    return s[0] / s[-1]


def close(got, want):
    assert abs(got - want) <= RTOL * abs(want), (got, want)


def test_analyze_against_numpy():
    ref = np.load(os.path.join(DATA, "bert_legacy.npz"))
    heads, lam = 2, 3.0
    rows = sc.analyze(os.path.join(DATA, "bert_legacy.bin"), heads=heads, lam=lam, per_head=True)
    assert rows.heads_from == "heads="
    # 2 layers x (3 whole matrices + 2 heads x 3 blocks)
    assert len(rows) == 2 * (3 + heads * 3)
    for r in rows:
        name = {"W_Q": "query", "W_K": "key", "W_V": "value"}[r.matrix]
        W = ref[f"encoder.layer.{r.layer}.attention.self.{name}.weight"].astype(np.float64).T
        assert r.tensor == f"encoder.layer.{r.layer}.attention.self.{name}.weight"
        D, width = W.shape
        d = width // heads
        if r.head is None:
            B, Ef, Ep = W, np.eye(D, width), np.hstack([np.eye(D, d)] * heads)
        else:
            sl = slice(r.head * d, (r.head + 1) * d)
            B, Ef, Ep = W[:, sl], np.eye(D, width)[:, sl], np.eye(D, d)
        s = np.linalg.svd(B, compute_uv=False)
        assert (r.rows, r.cols) == B.shape
        close(r.sigma_max, s[0])
        close(r.sigma_min, s[-1])
        close(r.kappa, s[0] / s[-1])
        close(r.kappa_lambda_fused, kap(B + lam * Ef))
        close(r.kappa_lambda_per_head, kap(B + lam * Ep))
        close(r.kappa_exact, 2 * s[0] / (s[0] + s[-1]))
        assert r.attention == "self" and r.shared_by == ""
    df = rows.to_pandas()
    assert list(df["matrix"][:3]) == ["W_Q", "W_K", "W_V"]
    assert df["head"].isna().sum() == 6


def test_heads_from_config_and_errors(tmp_path):
    import shutil
    shutil.copy(os.path.join(DATA, "bert_legacy.bin"), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="the number of heads is unknown"):
        sc.analyze(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    rows = sc.analyze(tmp_path)
    assert rows.heads_from.endswith("config.json")
    assert rows[0].kappa_lambda_per_head != rows[0].kappa_lambda_fused  # 4 heads of d = 2
    with pytest.raises(sc.CheckpointError, match="heads = 3 does not divide"):
        sc.analyze(tmp_path, heads=3)


def test_analyze_equals_the_tools_report():
    """sc.analyze is the engine's analysis, the tool's: the same numbers, to the last bit."""
    import subprocess

    exe = os.environ.get("SPECTRAL_COND_EXE")
    if not exe:
        pytest.skip("SPECTRAL_COND_EXE is not set (ctest sets it to the tool)")
    path = os.path.join(DATA, "bert_legacy.bin")
    rows = sc.analyze(path, heads=2, lam=3.0, per_head=True)
    doc = json.loads(subprocess.run([exe, "analyze", path, "--heads", "2", "--lambda", "3",
                                     "--per-head", "--format", "json", "--quiet"],
                                    capture_output=True, text=True, check=True).stdout)
    want = []
    for L in doc["checkpoints"][0]["layers"]:
        for blocks in [[(None, L)]] + [[(h["head"], h)] for h in L.get("per_head", [])]:
            for head, b in blocks:
                for m in ("W_Q", "W_K", "W_V"):
                    want.append((L["index"], head, m, float(b[m]["kappa"]),
                                 float(b[m]["lambda_fused"]["kappa"]),
                                 float(b[m]["lambda_per_head"]["kappa"]),
                                 float(b[m]["exact"]["kappa"])))
    got = [(r.layer, r.head, r.matrix, r.kappa, r.kappa_lambda_fused, r.kappa_lambda_per_head,
            r.kappa_exact) for r in rows]
    assert got == want
