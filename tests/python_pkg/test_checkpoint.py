"""spectral_cond.open_checkpoint: the library's reader from Python, against numpy and torch on
the fixtures tests/data/ holds (written by torch.save, numpy and gguf-py)."""
import os

import numpy as np
import pytest

import spectral_cond as sc

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")


def test_pytorch_against_numpy():
    ck = sc.open_checkpoint(os.path.join(DATA, "pytorch", "bert_legacy.bin"))
    ref = np.load(os.path.join(DATA, "pytorch", "bert_legacy.npz"))
    assert ck.format == "pytorch"
    assert ck.names() == sorted(ref.files)
    assert len(ck) == len(ref.files)
    for k in ref.files:
        assert ck.shape(k) == ref[k].shape
        assert ck.dtype(k) == "F32"
        if ref[k].ndim == 2:
            m = ck.matrix(k)
            assert m.dtype == np.float64
            np.testing.assert_array_equal(m, ref[k].astype(np.float64))


def test_layers_and_projection():
    ck = sc.open_checkpoint(os.path.join(DATA, "pytorch", "mha_zip.bin"))
    layers = ck.layers()
    assert [L["index"] for L in layers] == [0, 1]
    assert layers[0]["layout"] == "torch-mha"
    q = layers[1]["k"]
    W = ck.projection(q["tensor"], q["transposed"], q["offset"], q["width"])
    ref = np.load(os.path.join(DATA, "pytorch", "mha_zip.npz"))[q["tensor"]]
    np.testing.assert_array_equal(W, ref[8:16].T.astype(np.float64))
    # kappa of that W through the package equals numpy's
    s = np.linalg.svd(W, compute_uv=False)
    assert abs(sc.kappa(W).kappa - s[0] / s[-1]) <= 1e-12 * s[0] / s[-1]


def test_gguf_and_a_path_object():
    import pathlib
    ck = sc.open_checkpoint(pathlib.Path(DATA) / "gguf" / "llama.gguf")
    assert ck.format == "gguf"
    wq = np.load(os.path.join(DATA, "gguf", "llama.attn_q.orig.npy"))
    np.testing.assert_array_equal(ck.matrix("blk.0.attn_q.weight"), wq)


def test_errors_name_the_file(tmp_path):
    p = tmp_path / "model.bin"
    p.write_bytes(b"\x1f\x8b\x08\x00junk")
    with pytest.raises(sc.CheckpointError, match="model.bin: unsupported format: this looks like a gzip"):
        sc.open_checkpoint(p)
    assert issubclass(sc.CheckpointError, OSError)
    ck = sc.open_checkpoint(os.path.join(DATA, "pytorch", "zip.pt"))
    with pytest.raises(sc.CheckpointError, match="no tensor 'nosuch'"):
        ck.matrix("nosuch")
    with pytest.raises(sc.CheckpointError, match="expected a 2-D matrix"):
        ck.matrix("bias")


def test_packed_layers_need_heads_and_map(tmp_path):
    # GPT-NeoX's fused tensor interleaves q, k, v per head: its slots exist once heads are known.
    rng = np.random.default_rng(3)
    D, h = 8, 4
    d = D // h
    T = rng.standard_normal((3 * D, D)).astype(np.float32)
    p = tmp_path / "neox.npz"
    np.savez(p, **{"gpt_neox.layers.0.attention.query_key_value.weight": T,
                   "enc.0.wq": T[:D], "enc.0.wk": T[D:2 * D], "enc.0.wv": T[2 * D:]})
    ck = sc.open_checkpoint(p)
    with pytest.raises(sc.CheckpointError, match="pass heads= to find them"):
        ck.layers()
    (L,) = ck.layers(heads=h)
    assert L["layout"] == "gpt-neox" and L["kv_heads"] == h and L["d_k"] == d
    q = L["q"]
    assert (q["block"], q["stride"]) == (d, 3 * d)
    W = ck.projection(q["tensor"], q["transposed"], q["offset"], q["width"], q["block"],
                      q["stride"])
    G = T.astype(np.float64).reshape(h, 3, d, D)
    np.testing.assert_array_equal(W, np.concatenate([G[j, 0].T for j in range(h)], axis=1))
    with pytest.raises(ValueError, match="outside"):
        ck.projection(q["tensor"], True, 5, q["width"], q["block"], q["stride"])  # ends at row 25 of 24
    # --map's expressions, from Python.
    (M,) = ck.layers(map=r"q=enc\.(\d+)\.wq,k=enc\.(\d+)\.wk,v=enc\.(\d+)\.wv")
    assert M["layout"] == "map" and M["k"]["tensor"] == "enc.0.wk" and not M["cross"]
