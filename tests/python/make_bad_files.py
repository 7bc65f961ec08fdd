#!/usr/bin/env python3
"""A corpus of malformed or unusable checkpoints for `spectral-cond analyze`.

Every case must make `analyze` exit with code 2 and print exactly one line on stderr that names
the offending file, without crashing or hanging. Used by test_cli_checkpoints.py; run alone it
writes the corpus into a directory and lists it:

    python make_bad_files.py OUTDIR
"""
import io
import json
import os
import struct
import sys
import zipfile

import numpy as np


def _safetensors_bytes(header, data, header_len=None):
    js = json.dumps(header).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    n = len(js) if header_len is None else header_len
    return struct.pack("<Q", n) + js + data


def _timm_tensors(D=8, nan=False):
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((3 * D, D)).astype(np.float32)
    if nan:
        qkv[D + 1, 2] = np.nan
    fc1 = rng.standard_normal((4 * D, D)).astype(np.float32)
    return {"blocks.0.attn.qkv.weight": qkv, "blocks.0.mlp.fc1.weight": fc1}


def _good_safetensors(tensors):
    header, chunks, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.tobytes()
        dt = {np.float32: "F32", np.float64: "F64", np.float16: "F16"}[a.dtype.type]
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    return header, b"".join(chunks)


def _npy_bytes(arr, descr=None, fortran="False", version=(1, 0), magic=b"\x93NUMPY"):
    descr = descr or arr.dtype.str
    d = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, tuple(arr.shape))
    hl = len(d) + 1
    pad = (64 - (10 + hl) % 64) % 64
    h = (d + " " * pad + "\n").encode()
    return magic + bytes(version) + struct.pack("<H", len(h)) + h + arr.tobytes()


def _npy_dir(root, name, member_bytes):
    """A directory of .npy files: a valid timm layer plus one bad member."""
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    for k, v in _timm_tensors().items():
        np.save(os.path.join(d, k + ".npy"), v)
    bad = os.path.join(d, "blocks.0.attn.qkv.weight.npy")
    with open(bad, "wb") as f:
        f.write(member_bytes)
    return d, bad


def make_corpus(root):
    """Writes every case under `root`; returns a list of dicts:
    path (what to pass to analyze), names (a string stderr must contain), args (extra options),
    what (a description)."""
    os.makedirs(root, exist_ok=True)
    cases = []

    def write(name, data):
        p = os.path.join(root, name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def add(path, what, args=("--heads", "2"), names=None):
        cases.append({"path": path, "what": what, "args": list(args), "names": names or path})

    header, data = _good_safetensors(_timm_tensors())
    good = _safetensors_bytes(header, data)

    add(write("truncated.safetensors", good[: len(good) // 2]), "truncated file")
    add(write("truncated_in_length.safetensors", good[:5]), "shorter than the length prefix")
    add(write("header_too_long.safetensors", _safetensors_bytes(header, data, len(good) * 4)),
        "header length larger than the file")
    add(write("huge_header.safetensors", struct.pack("<Q", 2**63) + b"{}"),
        "header length near 2^63")
    add(write("invalid_json.safetensors", struct.pack("<Q", 16) + b'{"a": [1, 2,,}  '),
        "invalid JSON")
    h = json.loads(json.dumps(header))
    h["blocks.0.attn.qkv.weight"]["data_offsets"][1] += 1000
    add(write("offsets_out_of_range.safetensors", _safetensors_bytes(h, data)),
        "data offsets beyond the buffer")
    h = json.loads(json.dumps(header))
    b0, e0 = h["blocks.0.attn.qkv.weight"]["data_offsets"]
    b1, e1 = h["blocks.0.mlp.fc1.weight"]["data_offsets"]
    first = "blocks.0.attn.qkv.weight" if b0 < b1 else "blocks.0.mlp.fc1.weight"
    other = "blocks.0.mlp.fc1.weight" if first == "blocks.0.attn.qkv.weight" else first
    fb, fe = h[first]["data_offsets"]
    ob, oe = h[other]["data_offsets"]
    h[other]["data_offsets"] = [fe - 8, fe - 8 + (oe - ob)]
    add(write("overlapping.safetensors", _safetensors_bytes(h, data)), "overlapping tensors")
    h = json.loads(json.dumps(header))
    h["blocks.0.attn.qkv.weight"]["shape"] = [24, 9]
    add(write("shape_mismatch.safetensors", _safetensors_bytes(h, data)),
        "shape x dtype != byte length")
    h = json.loads(json.dumps(header))
    h["blocks.0.attn.qkv.weight"]["dtype"] = "F33"
    add(write("unknown_dtype.safetensors", _safetensors_bytes(h, data)), "unknown dtype")
    h = json.loads(json.dumps(header))
    h["blocks.0.attn.qkv.weight"]["dtype"] = "I32"
    add(write("integer_weights.safetensors", _safetensors_bytes(h, data)),
        "attention weights of an integer dtype")
    add(write("not_an_object.safetensors", _safetensors_bytes([1, 2, 3], b"")),
        "header is not an object")
    add(write("empty.safetensors", b""), "empty file")

    nh, nd = _good_safetensors(_timm_tensors(nan=True))
    add(write("nan_weights.safetensors", _safetensors_bytes(nh, nd)), "NaN weights",
        names=None)
    cases[-1]["names"] = [cases[-1]["path"], "blocks.0.attn.qkv.weight"]
    rng = np.random.default_rng(1)
    nh, nd = _good_safetensors({"mlp.fc1.weight": rng.standard_normal((8, 4)).astype(np.float32),
                                "head.weight": rng.standard_normal((3, 8)).astype(np.float32)})
    add(write("no_attention.safetensors", _safetensors_bytes(nh, nd)), "no attention layers")
    add(write("heads_do_not_divide.safetensors", good), "heads do not divide D",
        args=("--heads", "3"))
    add(write("no_heads.safetensors", good), "heads unknown (no --heads, no config.json)",
        args=())

    arr = _timm_tensors()["blocks.0.attn.qkv.weight"]
    for name, raw in [
        ("npy_bad_magic", _npy_bytes(arr, magic=b"\x93NUMPX")),
        ("npy_bad_version", _npy_bytes(arr, version=(9, 0))),
        ("npy_fortran_malformed", _npy_bytes(arr, fortran="Maybe")),
        ("npy_big_endian", _npy_bytes(arr.astype(">f4"), descr=">f4")),
        ("npy_truncated", _npy_bytes(arr)[:-7]),
        ("npy_int", _npy_bytes(arr.astype("<i4"), descr="<i4")),
    ]:
        d, bad = _npy_dir(root, name, raw)
        add(d, name.replace("_", " "), names=bad)

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "this is not an npz")
    add(write("zip_not_npz.npz", buf.getvalue()), "a zip that is not an .npz")
    add(write("text_not_zip.npz", b"hello, world\n" * 10), "not a zip at all")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("blocks.0.attn.qkv.weight.npy", _npy_bytes(arr, magic=b"\x93NUMPX"))
    add(write("npz_bad_member.npz", buf.getvalue()), "an .npz whose member is not a .npy")
    good_npz = io.BytesIO()
    np.savez(good_npz, **_timm_tensors())
    raw = bytearray(good_npz.getvalue())
    raw[len(raw) // 3] ^= 0xFF
    add(write("npz_corrupt.npz", bytes(raw)), "an .npz with a flipped byte (CRC)")

    idx = {"metadata": {}, "weight_map": {"blocks.0.attn.qkv.weight": "missing-00001.safetensors"}}
    add(write("missing_shard.safetensors.index.json", json.dumps(idx).encode()),
        "an index naming a shard that does not exist")
    add(write("bad_index.safetensors.index.json", b"{not json"), "an index that is not JSON")
    add(os.path.join(root, "does_not_exist.safetensors"), "a file that does not exist")
    return cases


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "bad_files"
    for c in make_corpus(out):
        print(f"{c['path']}\t{c['what']}\t{' '.join(c['args'])}")
