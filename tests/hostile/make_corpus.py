#!/usr/bin/env python3
"""A hostile corpus for `spectral-cond`: files and command lines that must be refused cleanly.

Every case is one kind of hostile input (a malformed or unusable .npy, .npz, safetensors file,
sharded checkpoint, a PyTorch .bin / .pt, an unsupported .gguf file, a special file where a file is expected,
or a command-line argument out of range). Each one must make the tool exit with code 2 and print
exactly one line on stderr that contains the case's `expect` substring (the file, tensor or
argument at fault), in well under a second and 100 MB. A few cases (`exit` 0) are inputs that
are unusual but valid (names that are not UTF-8) and must be reported, not fatal.

Everything is made by code here (stdlib and numpy only); nothing binary is committed. Run alone
it writes the corpus and its manifest:

    python make_corpus.py OUTDIR        # OUTDIR/manifest.json lists the cases

A case is {"id", "format", "argv" (after the executable), "exit", "expect", "note"}.
"""
import json
import os
import stat
import struct
import sys
import zipfile
import zlib

import numpy as np

I63 = 2**63 - 1


# ---------------------------------------------------------------------------------------------
# Byte builders.


def npy_bytes(arr=None, descr=None, shape=None, fortran="False", version=(1, 0),
              magic=b"\x93NUMPY", header=None, data=None):
    """A .npy file; every part can be overridden to make it malformed."""
    if arr is not None:
        descr = descr or arr.dtype.str
        shape = arr.shape if shape is None else shape
        data = arr.tobytes() if data is None else data
    if header is None:
        header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran,
                                                                         tuple(shape))
    h = header.encode("latin-1") if isinstance(header, str) else header
    lenbytes = 2 if version[0] == 1 else 4
    pad = (64 - (len(magic) + 2 + lenbytes + len(h) + 1) % 64) % 64
    h = h + b" " * pad + b"\n"
    ln = struct.pack("<H", len(h)) if lenbytes == 2 else struct.pack("<I", len(h))
    return magic + bytes(version) + ln + h + (data or b"")


def st_bytes(header, data=b"", header_len=None, raw_json=None, compact=False):
    """A safetensors file from a header dict (or raw JSON bytes)."""
    seps = (",", ":") if compact else None
    js = raw_json if raw_json is not None else json.dumps(header, separators=seps).encode()
    js += b" " * ((8 - len(js) % 8) % 8)
    n = len(js) if header_len is None else header_len
    return struct.pack("<Q", n) + js + data


def st_tensors(tensors, metadata=None):
    """(header, data) of a valid safetensors file from name -> float array."""
    header, chunks, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        b = a.tobytes()
        dt = {np.float32: "F32", np.float64: "F64", np.float16: "F16", np.int32: "I32"}[
            a.dtype.type]
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    return header, b"".join(chunks)


def timm(D=8, dtype=np.float32, layers=1, seed=7):
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(layers):
        t[f"blocks.{i}.attn.qkv.weight"] = (0.3 * rng.standard_normal((3 * D, D))).astype(dtype)
        t[f"blocks.{i}.mlp.fc1.weight"] = (0.3 * rng.standard_normal((4 * D, D))).astype(dtype)
    return t


def good_st(tensors=None, metadata=None):
    h, d = st_tensors(tensors if tensors is not None else timm())
    if metadata is not None:
        h["__metadata__"] = metadata
    return st_bytes(h, d)


def npz_bytes(members, compress=False):
    """An .npz from name -> .npy bytes (raw members, so they can be malformed)."""
    import io
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for name, b in members.items():
            z.writestr(name, b)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# The corpus.


class Corpus:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.cases = []

    def path(self, name):
        return os.path.join(self.root, name)

    def write(self, name, data):
        p = self.path(name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def add(self, cid, fmt, argv, expect, exit=2, note="", cpu_factor=1.0):
        """cpu_factor: this case's CPU budget in units of test_hostile.MAX_SECONDS."""
        self.cases.append({"id": cid, "format": fmt, "argv": [str(a) for a in argv],
                           "exit": exit, "expect": expect, "note": note,
                           "cpu_factor": cpu_factor})


def good_npy_set(c):
    """Valid X, W_Q, W_K, W_V for kappa / jacobian (N = 4, D = 3, d = 2)."""
    rng = np.random.default_rng(3)
    paths = {}
    for name, shape in (("X", (4, 3)), ("WQ", (3, 2)), ("WK", (3, 2)), ("WV", (3, 2))):
        paths[name] = c.write(f"good/{name}.npy", npy_bytes(rng.standard_normal(shape)))
    return paths


def npy_cases(c, g):
    f64 = np.arange(6, dtype=np.float64).reshape(2, 3)

    def kappa_matrix(cid, data, note, expect=None):
        p = c.write(f"npy/{cid}.npy", data)
        c.add(cid, "npy", ["kappa", "--matrix", p], expect or os.path.basename(p), note=note)

    kappa_matrix("npy_huge_empty_dim", npy_bytes(descr="<f8", shape=(I63, 0)),
                 "shape (2^63-1, 0): 128 bytes, no data, a loop of 2^63 rows")
    kappa_matrix("npy_zero_by_huge", npy_bytes(descr="<f8", shape=(0, I63)),
                 "shape (0, 2^63-1)")
    kappa_matrix("npy_three_huge_dims", npy_bytes(descr="<f8", shape=(2**40, 2**40, 0)),
                 "shape (2^40, 2^40, 0)")
    kappa_matrix("npy_bad_magic", npy_bytes(f64, magic=b"\x93NUMPZ"), "bad magic")
    kappa_matrix("npy_truncated_preamble", b"\x93NUMPY\x01", "ends inside the version")
    kappa_matrix("npy_header_len_huge", b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**31) + b"{",
                 "header length 2 GiB")
    kappa_matrix("npy_header_past_eof", b"\x93NUMPY\x01\x00" + struct.pack("<H", 5000) + b"{}",
                 "header length beyond the file")
    kappa_matrix("npy_version_9", npy_bytes(f64, version=(9, 0)), "unknown version")
    kappa_matrix("npy_big_endian", npy_bytes(f64.astype(">f8")), "big-endian dtype")
    kappa_matrix("npy_int32", npy_bytes(np.arange(6, dtype="<i4").reshape(2, 3)), "integers")
    kappa_matrix("npy_object", npy_bytes(descr="|O", shape=(2, 3), data=b"\0" * 48),
                 "object dtype (pickle)")
    kappa_matrix("npy_structured",
                 npy_bytes(header="{'descr': [('a', '<f8')], 'fortran_order': False, "
                           "'shape': (2,), }", data=b"\0" * 16), "structured dtype")
    kappa_matrix("npy_shape_overflow", npy_bytes(descr="<f8", shape=(2**40, 2**40)),
                 "element count overflows")
    kappa_matrix("npy_negative_dim",
                 npy_bytes(header="{'descr': '<f8', 'fortran_order': False, 'shape': (-1, 3), }"),
                 "negative dimension")
    kappa_matrix("npy_truncated_data", npy_bytes(f64)[:-8], "data shorter than the shape")
    kappa_matrix("npy_trailing_bytes", npy_bytes(f64) + b"\0" * 8, "bytes after the data")
    kappa_matrix("npy_dup_key",
                 npy_bytes(header="{'descr': '<f8', 'descr': '<f8', 'fortran_order': False, "
                           "'shape': (2, 3), }", data=f64.tobytes()), "duplicate header key")
    kappa_matrix("npy_non_ascii_header",
                 npy_bytes(header=b"{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), "
                           b"'\xff': 1}", data=f64.tobytes()), "non-ASCII header byte")
    kappa_matrix("npy_bad_bool",
                 npy_bytes(header="{'descr': '<f8', 'fortran_order': Maybe, 'shape': (2, 3), }",
                           data=f64.tobytes()), "fortran_order neither True nor False")
    kappa_matrix("npy_unterminated",
                 npy_bytes(header="{'descr': '<f8", data=b""), "unterminated string")
    nan = f64.copy()
    nan[1, 2] = np.nan
    kappa_matrix("npy_nan", npy_bytes(nan), "a NaN entry")
    inf = f64.astype("<f2")
    inf[0, 1] = np.inf
    kappa_matrix("npy_f16_inf", npy_bytes(inf), "an Inf entry (float16)")
    kappa_matrix("npy_3d", npy_bytes(np.zeros((2, 2, 2))), "3-D where a matrix is expected")
    kappa_matrix("npy_1d", npy_bytes(np.zeros(4)), "1-D where a matrix is expected")
    kappa_matrix("npy_empty_rows", npy_bytes(np.zeros((0, 3))), "0 x 3 matrix")
    kappa_matrix("npy_empty_file", b"", "0-byte file")

    # Special files where a .npy is expected.
    fifo = c.path("npy/fifo.npy")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    c.add("npy_fifo", "npy", ["kappa", "--matrix", fifo], "fifo.npy",
          note="a FIFO: opening it must not block")
    os.makedirs(c.path("npy/dir.npy"), exist_ok=True)
    c.add("npy_directory", "npy", ["kappa", "--matrix", c.path("npy/dir.npy")], "dir.npy",
          note="a directory")
    dev = c.path("npy/zero.npy")
    if not os.path.lexists(dev):
        os.symlink("/dev/zero", dev)
    c.add("npy_device", "npy", ["kappa", "--matrix", dev], "zero.npy",
          note="a symlink to /dev/zero (a character device)")
    c.add("npy_missing", "npy", ["kappa", "--matrix", c.path("npy/missing.npy")], "missing.npy",
          note="no such file")

    # Attention inputs: X through the jacobian and kappa subcommands.
    xfifo = c.path("npy/X_fifo.npy")
    if not os.path.exists(xfifo):
        os.mkfifo(xfifo)
    c.add("npy_fifo_jacobian_x", "npy",
          ["jacobian", "--x", xfifo, "--wq", g["WQ"], "--wk", g["WK"], "--wv", g["WV"],
           "--out", c.path("out/J.npy")], "X_fifo.npy", note="jacobian --x FIFO")
    xbig = c.write("npy/X_overflow.npy", npy_bytes(np.full((4, 3), 1e200)))
    c.add("npy_overflow_logits", "npy",
          ["kappa", "--x", xbig, "--wq", g["WQ"], "--wk", g["WK"], "--wv", g["WV"], "--bound"],
          "X_overflow.npy", exit=3, note="finite X whose logits overflow: a numerical failure "
          "(exit 3, docs/cli.md) naming the inputs, never a verdict drawn from NaN")
    c.add("npy_overflow_logits_gram", "npy",
          ["kappa", "--x", xbig, "--wq", g["WQ"], "--wk", g["WK"], "--wv", g["WV"], "--method",
           "gram"], "X_overflow.npy", exit=3, note="finite X whose J is NaN: exit 3, never a "
          "'zero matrix'")
    huge = c.write("npy/M_huge.npy", npy_bytes(np.full((3, 2), 1e300) * np.array([[1, 2]])))
    c.add("npy_overflow_matrix", "npy", ["kappa", "--matrix", huge], "M_huge.npy", exit=0,
          note="entries 1e300: kappa is scale-invariant, must be finite and right (exit 0)")


def npz_cases(c):
    good = timm()
    arrays = {k + ".npy": npy_bytes(v) for k, v in good.items()}

    def analyze(cid, data, note, expect=None, extra=()):
        p = c.write(f"npz/{cid}.npz", data)
        c.add(cid, "npz", ["analyze", p, "--heads", "2", *extra], expect or os.path.basename(p),
              note=note)

    analyze("npz_not_zip", b"PK\x03\x04 not a zip at all" * 3, "no end-of-central-directory")
    analyze("npz_empty_file", b"", "0 bytes")
    analyze("npz_non_npy_member", npz_bytes({"evil.pkl": b"cos\nsystem\n"}), "a pickle member")
    dup = npz_bytes({"a.npy": npy_bytes(np.zeros((2, 2)))})
    analyze("npz_duplicate_member",
            npz_bytes_dup(npy_bytes(np.zeros((2, 2)))), "two members called a.npy")
    del dup
    raw = bytearray(npz_bytes(arrays))
    raw[raw.find(b"NUMPY") + 300] ^= 0x01  # inside the data of the first member, past its header
    analyze("npz_crc_mismatch", bytes(raw), "flipped data byte", expect="CRC")
    analyze("npz_truncated", npz_bytes(arrays)[:-30], "cut inside the central directory")
    bad_member = dict(arrays)
    bad_member["blocks.0.attn.qkv.weight.npy"] = npy_bytes(good["blocks.0.attn.qkv.weight"]
                                                           .astype(">f4"))
    analyze("npz_big_endian_member", npz_bytes(bad_member), "big-endian member",
            expect="blocks.0.attn.qkv.weight")
    nanm = dict(good)
    nanm["blocks.0.attn.qkv.weight"] = nanm["blocks.0.attn.qkv.weight"].copy()
    nanm["blocks.0.attn.qkv.weight"][3, 1] = np.nan
    analyze("npz_nan_member", npz_bytes({k + ".npy": npy_bytes(v) for k, v in nanm.items()},
                                        compress=True), "NaN in W", expect="blocks.0.attn.qkv")
    analyze("npz_huge_empty_member",
            npz_bytes({"blocks.0.attn.qkv.weight.npy": npy_bytes(descr="<f8", shape=(I63, 0))}),
            "member of shape (2^63-1, 0)")
    # A 256 KB archive whose non-attention member inflates to 256 MB of float16 zeros (1 GB as
    # doubles): only its header may be read.
    p = c.path("npz/npz_inflating_member.npz")
    if not os.path.exists(p):
        write_inflating_npz(p)
    c.add("npz_inflating_member", "npz", ["analyze", p, "--heads", "2"],
          "npz_inflating_member.npz",
          note="compressed non-attention member of 256 MB; no attention layer")
    # Member names that are not UTF-8: reported, not fatal.
    weird = {k + ".npy": npy_bytes(v) for k, v in good.items()}
    weird["caf\xe9.npy"] = npy_bytes(np.zeros((2, 2)))
    p = c.write("npz/npz_latin1_name.npz", npz_latin1(weird))
    c.add("npz_non_utf8_member_json", "npz", ["analyze", p, "--heads", "2", "--format", "json"],
          "", exit=0, note="a member name that is not UTF-8, with --format json")


def npz_bytes_dup(member):
    """A stored zip with two members of the same name (zipfile warns, but writes it)."""
    import io
    import warnings
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("a.npy", member)
            z.writestr("a.npy", member)
    return buf.getvalue()


def npz_latin1(members):
    """A stored zip whose names are raw bytes (latin-1), not UTF-8: written by hand."""
    local, central, off = [], [], 0
    for name, data in members.items():
        nb = name.encode("latin-1")
        crc = zlib.crc32(data)
        lh = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data),
                         len(nb), 0) + nb
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc,
                                   len(data), len(data), len(nb), 0, 0, 0, 0, 0, off) + nb)
        local.append(lh + data)
        off += len(lh) + len(data)
    cd = b"".join(central)
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(cd), off, 0)
    return b"".join(local) + cd + eocd


def write_inflating_npz(path):
    n = 128 * 2**20  # float16 elements: 256 MB
    hdr = npy_bytes(descr="<f2", shape=(n,), data=b"")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("mlp.fc1.weight.npy", "w", force_zip64=True) as f:
            f.write(hdr)
            chunk = b"\0" * 2**22
            for _ in range(2 * n // len(chunk)):
                f.write(chunk)


def st_cases(c):
    h, d = st_tensors(timm())

    def analyze(cid, data, note, expect=None, extra=("--heads", "2"), name=None):
        p = c.write(f"st/{name or cid}.safetensors", data)
        c.add(cid, "safetensors", ["analyze", p, *extra], expect or os.path.basename(p), note=note)
        return p

    analyze("st_too_short", b"\x01\x02", "3 bytes")
    analyze("st_header_len_huge", struct.pack("<Q", 2**63) + b"{}", "header length 2^63")
    analyze("st_header_past_eof", struct.pack("<Q", 4096) + b"{}      ", "header beyond the file")
    analyze("st_not_json", st_bytes(None, raw_json=b"{not json"), "invalid JSON")
    analyze("st_json_array", st_bytes(None, raw_json=b"[1, 2, 3]"), "JSON array")
    qkv = json.dumps(h["blocks.0.attn.qkv.weight"])
    raw_dup_top = ('{"blocks.0.attn.qkv.weight": %s, "blocks.0.attn.qkv.weight": %s}'
                   % (qkv, qkv)).encode()
    analyze("st_dup_top_key", st_bytes(None, raw_json=raw_dup_top, data=d), "duplicate tensor")
    e = h["blocks.0.attn.qkv.weight"]
    raw_dup_entry = ('{"blocks.0.attn.qkv.weight": {"dtype": "F64", "dtype": "%s", "shape": %s, '
                     '"data_offsets": %s}}' % (e["dtype"], json.dumps(e["shape"]),
                                              json.dumps(e["data_offsets"]))).encode()
    analyze("st_dup_key_in_entry", st_bytes(None, raw_json=raw_dup_entry, data=d),
            "dtype twice inside one entry", expect="dtype")
    hm = dict(h)
    raw_dup_meta = (json.dumps(hm)[:-1] + ', "__metadata__": {"a": "1", "a": "2"}}').encode()
    analyze("st_dup_metadata_key", st_bytes(None, raw_json=raw_dup_meta, data=d),
            "duplicate key in __metadata__", expect="'a'")
    analyze("st_metadata_not_str", st_bytes(dict(h, __metadata__={"a": 1}), d), "metadata value 1")

    def entry(cid, note, expect="blocks.0.attn.qkv.weight", **over):
        hh = json.loads(json.dumps(h))
        hh["blocks.0.attn.qkv.weight"].update(over)
        for k in [k for k, v in over.items() if v is None]:
            del hh["blocks.0.attn.qkv.weight"][k]
        analyze(cid, st_bytes(hh, d), note, expect=expect)

    entry("st_unknown_dtype", "dtype Q7", dtype="Q7")
    entry("st_negative_dim", "shape [-24, 8]", shape=[-24, 8])
    entry("st_float_dim", "shape [24.0, 8]", shape=[24.5, 8])
    entry("st_shape_overflow", "2^40 x 2^40", shape=[2**40, 2**40])
    entry("st_huge_empty_dim", "shape [2^62, 0] with no bytes", shape=[2**62, 0],
          data_offsets=[0, 0])
    entry("st_offsets_past_end", "end beyond the buffer", data_offsets=[0, 10**9])
    entry("st_offsets_reversed", "end < begin", data_offsets=[64, 0])
    entry("st_offsets_length", "length != numel x size", data_offsets=[0, 100])
    entry("st_extra_field", "unexpected field", extra=1)
    entry("st_missing_field", "no shape", shape=None)
    entry("st_integer_qkv", "I32 attention weight", dtype="I32")
    entry("st_3d_qkv", "3-D qkv", shape=[2, 12, 8])
    entry("st_qkv_not_3d", "qkv 20 x 8", shape=[20, 8], data_offsets=[0, 640])
    hh = json.loads(json.dumps(h))
    a, b = hh["blocks.0.attn.qkv.weight"]["data_offsets"]
    hh["blocks.0.mlp.fc1.weight"]["data_offsets"] = [a, a + (b - a)]
    hh["blocks.0.mlp.fc1.weight"]["shape"] = [24, 8]
    analyze("st_overlap", st_bytes(hh, d), "two tensors on the same bytes")

    nan = timm()
    nan["blocks.0.attn.qkv.weight"][5, 5] = np.nan
    analyze("st_nan_weight", good_st(nan), "NaN in W", expect="blocks.0.attn.qkv.weight")
    inf16 = timm(dtype=np.float16)
    inf16["blocks.0.attn.qkv.weight"][2, 2] = np.inf
    analyze("st_f16_inf_weight", good_st(inf16), "Inf in an F16 W",
            expect="blocks.0.attn.qkv.weight")
    big = timm(dtype=np.float64)
    big["blocks.0.attn.qkv.weight"] *= 1e300
    analyze("st_overflowing_weights", good_st(big), "entries 1e300: kappa must stay finite",
            expect="", extra=("--heads", "2", "--format", "json"), name="st_overflowing_weights")
    c.cases[-1]["exit"] = 0
    analyze("st_no_attention", good_st({"mlp.fc1.weight": np.zeros((4, 4), np.float32)}),
            "no attention layer")
    analyze("st_no_heads", good_st(), "heads unknown", extra=())
    # 60,000 tensors in 4.5 MB (hf-bert names, 20,000 layers): detection must stay linear.
    p = c.path("st/st_60000_tensors.safetensors")
    if not os.path.exists(p):
        hh = {}
        for i in range(20000):
            for r in ("query", "key", "value"):
                hh[f"e.{i}.attention.self.{r}.weight"] = {
                    "dtype": "F32", "shape": [1, 1], "data_offsets": [0, 0]}
        # 60,000 empty-looking entries that share no bytes: give each its own 4 bytes.
        off = 0
        for k in sorted(hh):
            hh[k]["data_offsets"] = [off, off + 4]
            off += 4
        c.write("st/st_60000_tensors.safetensors",
                st_bytes(hh, b"\0\0\x80\x3f" * (off // 4), compact=True))
    # A 6 MB header is parsed into 60,000 entries (a SAX pass that builds no JSON document) and
    # 20,000 layers are matched by fixed name patterns: about 0.5 s of CPU on the 2-core
    # development machine, inside the 1 s every case has (a quadratic parse, the defect this case
    # was made for, took minutes; the DOM parse and regular expressions before, about 1 s).
    c.add("st_60000_tensors", "safetensors", ["analyze", p], "st_60000_tensors.safetensors",
          note="60,000 tensors, heads unknown: refused after detection, in linear time")
    c.add("st_60000_tensors_layers", "safetensors",
          ["analyze", p, "--heads", "1", "--layers", "0-50000000"], "--layers",
          note="a range of 50 million layers: never expanded")

    # Special files named like checkpoints.
    fifo = c.path("st/fifo.safetensors")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    c.add("st_fifo", "safetensors", ["analyze", fifo, "--heads", "2"], "fifo.safetensors",
          note="a FIFO")
    d2 = c.path("st/fifo_dir")
    os.makedirs(d2, exist_ok=True)
    if not os.path.exists(os.path.join(d2, "weights.safetensors")):
        os.mkfifo(os.path.join(d2, "weights.safetensors"))
    c.add("st_dir_with_fifo", "safetensors", ["analyze", d2, "--heads", "2"],
          "weights.safetensors", note="a directory whose only .safetensors is a FIFO")
    c.add("st_dev_null", "safetensors", ["analyze", "/dev/null", "--heads", "2"], "/dev/null",
          note="a character device")
    os.makedirs(c.path("st/empty_dir"), exist_ok=True)
    c.add("st_empty_dir", "safetensors", ["analyze", c.path("st/empty_dir"), "--heads", "2"],
          "empty_dir", note="an empty directory")

    # Non-UTF-8 path: reported, not fatal.
    try:
        wdir = os.path.join(os.fsencode(c.root), b"st", b"caf\xe9")
        os.makedirs(wdir, exist_ok=True)
        with open(os.path.join(wdir, b"model.safetensors"), "wb") as f:
            f.write(good_st())
        c.add("st_non_utf8_path_json", "safetensors",
              ["analyze", os.fsdecode(wdir), "--heads", "2", "--format", "json"], "", exit=0,
              note="a directory name that is not UTF-8, with --format json")
    except OSError:
        pass


def config_cases(c):
    def case(cid, text, note, expect="config.json"):
        d = c.path(f"config/{cid}")
        os.makedirs(d, exist_ok=True)
        c.write(f"config/{cid}/model.safetensors", good_st())
        c.write(f"config/{cid}/config.json", text)
        c.add(cid, "config.json", ["analyze", d], expect, note=note)

    case("config_dup_key", b'{"num_attention_heads": 2, "num_attention_heads": 4}',
         "duplicate key, last would win")
    case("config_not_json", b'{"num_attention_heads": ', "truncated JSON")
    case("config_heads_zero", b'{"num_attention_heads": 0}', "heads 0")
    case("config_heads_string", b'{"num_attention_heads": "2"}', "heads a string")
    case("config_nested_dup", b'{"num_attention_heads": 2, "x": {"a": 1, "a": 2}}',
         "duplicate key below the top level")
    case("config_hidden_mismatch", b'{"num_attention_heads": 2, "hidden_size": 9}',
         "hidden size 9, D = 8")


def sharded_cases(c):
    t = timm(layers=2)
    names = sorted(t)

    def shard_set(cid, index, shards, note, expect=None, cmd="analyze", extra=()):
        d = c.path(f"sharded/{cid}")
        os.makedirs(d, exist_ok=True)
        for fn, tensors in shards.items():
            c.write(f"sharded/{cid}/{fn}", good_st(tensors))
        ip = c.write(f"sharded/{cid}/model.safetensors.index.json",
                     index if isinstance(index, bytes) else json.dumps(index).encode())
        argv = [cmd, ip, "--heads", "2", *extra]
        if cmd == "correct":
            argv += ["--method", "lambda", "--out", c.path(f"sharded/{cid}.out.safetensors")]
        c.add(cid, "sharded", argv, expect or "model.safetensors.index.json", note=note)

    s1 = {n: t[n] for n in names[:2]}
    s2 = {n: t[n] for n in names[2:]}
    wm = {n: "a.safetensors" for n in s1} | {n: "b.safetensors" for n in s2}
    shard_set("sharded_not_json", b"{weight_map", {"a.safetensors": s1}, "index not JSON")
    shard_set("sharded_no_weight_map", {"metadata": {}}, {"a.safetensors": s1}, "no weight_map")
    raw = json.dumps({"weight_map": wm})
    raw = raw[:-2] + ', "%s": "b.safetensors"}}' % names[0]
    shard_set("sharded_dup_weight_map_key", raw.encode(), {"a.safetensors": s1,
              "b.safetensors": s2}, "a tensor listed twice", expect=names[0])
    shard_set("sharded_dup_top_key",
              ('{"weight_map": %s, "weight_map": {}}' % json.dumps(wm)).encode(),
              {"a.safetensors": s1, "b.safetensors": s2}, "weight_map twice")
    shard_set("sharded_missing_shard", {"weight_map": wm}, {"a.safetensors": s1},
              "shard b missing", expect="b.safetensors")
    shard_set("sharded_abs_path", {"weight_map": {n: "/etc/passwd" for n in names}},
              {"a.safetensors": s1}, "absolute shard path", expect="/etc/passwd")
    shard_set("sharded_dotdot", {"weight_map": {n: "../x.safetensors" for n in names}},
              {"a.safetensors": s1}, "shard outside the directory", expect="../x.safetensors")
    shard_set("sharded_value_not_str", {"weight_map": {names[0]: 3}}, {"a.safetensors": s1},
              "shard name 3", expect=names[0])
    wm_missing = dict(wm)
    wm_missing["blocks.9.attn.qkv.weight"] = "a.safetensors"
    shard_set("sharded_listed_not_in_shard", {"weight_map": wm_missing},
              {"a.safetensors": s1, "b.safetensors": s2}, "index lists a tensor the shard lacks",
              expect="blocks.9.attn.qkv.weight")
    extra_shard = dict(s2)
    extra_shard["blocks.1.extra.weight"] = np.zeros((2, 2), np.float32)
    shard_set("sharded_unlisted_tensor", {"weight_map": wm},
              {"a.safetensors": s1, "b.safetensors": extra_shard},
              "correct: a shard holds a tensor the index does not list",
              expect="blocks.1.extra.weight", cmd="correct")
    dup_shard = dict(s2)
    dup_shard[names[0]] = t[names[0]]
    shard_set("sharded_tensor_in_two_shards", {"weight_map": wm},
              {"a.safetensors": s1, "b.safetensors": dup_shard},
              "correct: a tensor in two shards", expect=names[0], cmd="correct")
    # A shard file that is a FIFO.
    d = c.path("sharded/sharded_fifo_shard")
    os.makedirs(d, exist_ok=True)
    c.write("sharded/sharded_fifo_shard/a.safetensors", good_st(s1))
    if not os.path.exists(os.path.join(d, "b.safetensors")):
        os.mkfifo(os.path.join(d, "b.safetensors"))
    ip = c.write("sharded/sharded_fifo_shard/model.safetensors.index.json",
                 json.dumps({"weight_map": wm}).encode())
    c.add("sharded_fifo_shard", "sharded", ["analyze", ip, "--heads", "2"], "b.safetensors",
          note="shard b is a FIFO")


def pt_unicode(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def pt_tensor(numel, shape, stride, offset=0, key="0"):
    """Pickle bytes of torch._utils._rebuild_tensor_v2 over FloatStorage `key` (legacy pid)."""
    def k(v):
        return b"K" + bytes([v])
    def tup(vs):
        return b"(" + b"".join(k(v) for v in vs) + b"t"
    return (b"ctorch._utils\n_rebuild_tensor_v2\n((" + pt_unicode("storage") +
            b"ctorch\nFloatStorage\n" + pt_unicode(key) + pt_unicode("cpu") + k(numel) +
            b"NtQ" + k(offset) + tup(shape) + tup(stride) + b"\x89ccollections\nOrderedDict\n)RtR")


def pt_legacy(obj, keys=(b"0",), storages=b""):
    """A legacy torch.save file: magic, protocol 1001, system info, obj, key list, storages."""
    magic = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
    key_list = b"]" + b"".join(pt_unicode(k.decode()) + b"a" for k in keys)
    return (magic + b"\x80\x02M\xe9\x03." + b"\x80\x02}." + b"\x80\x02" + obj + b"." +
            b"\x80\x02" + key_list + b"." + storages)


def pt_floats(vals):
    return struct.pack("<Q", len(vals)) + struct.pack(f"<{len(vals)}f", *vals)


def pt_zip(pickle, members):
    """A zip-format torch.save file: archive/data.pkl plus the given members."""
    import io as _io
    buf = _io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle)
        z.writestr("archive/byteorder", b"little")
        for name, data in members.items():
            z.writestr("archive/" + name, data)
    return buf.getvalue()


def pytorch_cases(c):
    """PyTorch checkpoints: read by a restricted unpickler that never calls a global."""
    # Malformed zips and pickles that are not torch.save's.
    p = c.write("bin/pytorch_model.bin", b"PK\x03\x04" + b"\0" * 26 + b"archive/data.pkl" +
                b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.")
    c.add("bin_truncated_zip", "bin", ["analyze", p, "--heads", "2"], "pytorch_model.bin",
          note="a zip-pickle .bin without a central directory")
    p = c.write("bin/model.pt", b"\x80\x02}q\x00.")
    c.add("pt_no_magic", "bin", ["analyze", p, "--heads", "2"], "model.pt",
          note="a pickle that is not torch.save's (no magic number)")
    d = c.path("bin/bin_dir")
    os.makedirs(d, exist_ok=True)
    c.write("bin/bin_dir/pytorch_model.bin", b"\x80\x02}q\x00.")
    c.add("bin_dir", "bin", ["analyze", d, "--heads", "2"], "pytorch_model.bin",
          note="a directory holding a bad pytorch_model.bin")
    p = c.write("bin/correct.bin", b"\x80\x02}q\x00.")
    c.add("bin_correct", "bin", ["correct", p, "--method", "lambda", "--out",
                                 c.path("bin/out.safetensors")], "correct.bin",
          note="correct on a bad .bin")
    w = b"}" + pt_unicode("w")
    legacy_cases = [
        ("pt_system", pt_legacy(b"cposix\nsystem\n" + pt_unicode("touch /tmp/sc-pwned") +
                                b"\x85R", keys=()),
         "a global (posix.system) applied to arguments: never called, no tensors"),
        ("pt_extent", pt_legacy(w + pt_tensor(4, (3, 3), (3, 1)) + b"s", storages=pt_floats([1] * 4)),
         "a 3 x 3 tensor over a 4-element storage"),
        ("pt_offset", pt_legacy(w + pt_tensor(4, (2, 2), (2, 1), offset=200) + b"s",
                                storages=pt_floats([1] * 4)), "a storage offset past the end"),
        ("pt_count", pt_legacy(w + pt_tensor(4, (2, 2), (2, 1)) + b"s", storages=pt_floats([1] * 5)),
         "storage count differs from its persistent id"),
        ("pt_short", pt_legacy(w + pt_tensor(4, (2, 2), (2, 1)) + b"s",
                               storages=pt_floats([1] * 4)[:12]), "storage bytes truncated"),
        ("pt_trailing", pt_legacy(w + pt_tensor(4, (2, 2), (2, 1)) + b"s",
                                  storages=pt_floats([1] * 4) + b"junk"), "bytes after the storages"),
        ("pt_huge_string", pt_legacy(b"X\xff\xff\xff\xff" + b"abc"), "a 4 GiB string length"),
        ("pt_opcode", pt_legacy(b"I12\n"), "a protocol-0 opcode torch.save never writes"),
        ("pt_memo", pt_legacy(b"h\x07"), "a memo entry that was never stored"),
        ("pt_qtensor", pt_legacy(b"ctorch._utils\n_rebuild_qtensor\n)R"), "a quantized tensor"),
        ("pt_values_bomb", pt_legacy(b"]" * (2**19 + 1)), "more values than a state dict needs"),
        ("pt_dup_bomb", pt_legacy(b"]" + b"2" * (2**22 + 1)), "a DUP bomb"),
        ("pt_dup_name", pt_legacy(w + pt_tensor(4, (2, 2), (2, 1)) + b"s" + pt_unicode("w") +
                                  pt_tensor(4, (2, 2), (2, 1)) + b"s", storages=pt_floats([1] * 4)),
         "a dict key given twice"),
        ("pt_nan", pt_legacy(b"}" + pt_unicode("blocks.0.attn.qkv.weight") +
                             pt_tensor(48, (12, 4), (4, 1)) + b"s",
                             storages=pt_floats([float("nan")] * 48)), "NaN weights"),
    ]
    for cid, data, note in legacy_cases:
        p = c.write(f"bin/{cid}.pt", data)
        c.add(cid, "bin", ["analyze", p, "--heads", "2"], f"{cid}.pt", note=note)
    zpkl = b"\x80\x02}" + pt_unicode("w") + pt_tensor(4, (2, 2), (2, 1))
    # The zip format's persistent id has five fields: drop the legacy view (the N before tQ).
    zpkl = zpkl.replace(b"\x04NtQ", b"\x04tQ") + b"s."
    zip_cases = [
        ("bin_no_storage", pt_zip(zpkl, {}), "the storage member is missing"),
        ("bin_storage_size", pt_zip(zpkl, {"data/0": b"\0" * 12}), "a storage member too short"),
        ("bin_no_pkl", pt_zip(b"", {"data/0": b"\0" * 16}).replace(b"data.pkl", b"data.pkX"),
         "a zip without data.pkl"),
    ]
    for cid, data, note in zip_cases:
        p = c.write(f"bin/{cid}.bin", data)
        c.add(cid, "bin", ["analyze", p, "--heads", "2"], f"{cid}.bin", note=note)

def unsupported_cases(c):
    # GGUF: magic, version 3, counts.
    gg = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 4) + b"blk0" + \
        struct.pack("<I", 2) + struct.pack("<QQ", 8, 8) + struct.pack("<IQ", 0, 0)
    p = c.write("gguf/model.gguf", gg)
    c.add("gguf", "gguf", ["analyze", p, "--heads", "2"], "model.gguf", note="a GGUF file")
    p = c.write("gguf/huge_count.gguf", b"GGUF" + struct.pack("<IQQ", 3, 2**63, 2**63))
    c.add("gguf_huge_counts", "gguf", ["analyze", p, "--heads", "2"], "huge_count.gguf",
          note="GGUF with 2^63 tensors")
    p = c.write("gguf/model_gguf.safetensors", gg)
    c.add("gguf_named_safetensors", "gguf", ["analyze", p, "--heads", "2"],
          "model_gguf.safetensors", note="GGUF bytes in a .safetensors name")


def cli_cases(c, g):
    model = c.write("cli/model.safetensors", good_st())
    att = ["--x", g["X"], "--wq", g["WQ"], "--wk", g["WK"], "--wv", g["WV"]]
    out = c.path("cli/out.npy")

    def case(cid, argv, expect, note):
        c.add(cid, "cli", argv, expect, note=note)

    case("cli_mask_upper", ["kappa", *att, "--mask", "CAUSAL"], "--mask", "CAUSAL is not causal")
    case("cli_heads_text", ["correct", model, "--heads", "x", "--method", "lambda", "--out",
                            c.path("cli/h.safetensors")], "--heads", "--heads x")
    case("cli_tokens_without_jacobian", ["analyze", model, "--heads", "2", "--tokens", "8"],
         "--tokens needs --jacobian", "--tokens would be ignored")
    case("cli_inputs_without_jacobian", ["analyze", model, "--heads", "2", "--inputs",
                                         c.path("cli/nosuch.npy")], "--inputs needs --jacobian",
         "--inputs would be ignored")
    case("cli_jacobian_heads_without_jacobian", ["analyze", model, "--heads", "2",
                                                 "--jacobian-heads", "0"],
         "--jacobian-heads needs --jacobian", "--jacobian-heads would be ignored")
    case("cli_jacobian_heads_beyond", ["analyze", model, "--heads", "2", "--jacobian",
                                       "--jacobian-heads", "2"], "--jacobian-heads",
         "head 2 of 2 heads")
    case("cli_correct_exact_lambda", ["correct", model, "--heads", "2", "--method", "exact",
                                      "--lambda", "3", "--out", c.path("cli/e.safetensors")],
         "--lambda applies to --method lambda", "--lambda with --method exact")
    case("cli_correct_out_npz", ["correct", model, "--method", "lambda", "--out",
                                 c.path("cli/corrected.npz")], "--out", "safetensors under .npz")
    case("cli_block_upper", ["jacobian", *att, "--block", "X", "--out", out], "--block",
         "X is not x")
    case("cli_format_upper", ["kappa", "--matrix", g["X"], "--format", "JSON"], "--format",
         "JSON is not json")
    case("cli_method_upper", ["kappa", *att, "--method", "QR"], "--method", "QR is not qr")
    case("cli_verify_format_upper", ["verify", "--format", "Json", "--instances-per-regime", "1"],
         "--format", "verify --format Json")
    case("cli_seed_negative", ["analyze", model, "--heads", "2", "--jacobian", "--seed", "-1"],
         "--seed", "-1 would wrap to 2^64-1")
    case("cli_verify_seed_negative", ["verify", "--seed", "-1"], "--seed", "verify --seed -1")
    case("cli_demo_seed_negative", ["demo", "--seed", "-5"], "--seed", "demo --seed -5")
    case("cli_tokens_huge", ["analyze", model, "--heads", "2", "--jacobian", "--tokens",
                             "1000000000"], "--tokens", "a billion tokens")
    case("cli_tokens_zero", ["analyze", model, "--heads", "2", "--jacobian", "--tokens", "0"],
         "--tokens", "zero tokens")
    case("cli_demo_tokens_huge", ["demo", "--tokens", "1000000000"], "--tokens",
         "demo with a billion tokens")
    case("cli_layers_huge_range", ["analyze", model, "--heads", "2", "--layers", "0-50000000"],
         "--layers", "50 million layers")
    case("cli_layers_garbage", ["analyze", model, "--heads", "2", "--layers", "1,,x"], "--layers",
         "not a list")
    case("cli_layers_decreasing", ["analyze", model, "--heads", "2", "--layers", "5-3"],
         "--layers", "decreasing range")
    case("cli_map_bad_regex", ["analyze", model, "--heads", "2", "--map", "q=(a,k=b,v=c"],
         "--map: q: not a valid regular expression", "--map with an unbalanced parenthesis")
    case("cli_map_missing_v", ["analyze", model, "--heads", "2", "--map", "q=a,k=b"],
         "--map: v is missing", "--map without v")
    case("cli_map_garbage", ["analyze", model, "--heads", "2", "--map", "whatever"],
         "--map: expected", "--map that is no key=value list")
    case("cli_map_no_match", ["analyze", model, "--heads", "2", "--map", "q=x,k=y,v=z"],
         "--map matched no tensor", "--map that matches nothing")
    case("cli_map_with_layout", ["analyze", model, "--heads", "2", "--layout", "timm", "--map",
                                 r"qkv=blocks\.(\d+)\.attn\.qkv\.weight"],
         "--map replaces the built-in layouts", "--map and --layout together")
    case("cli_correct_map_bad", ["correct", model, "--method", "lambda", "--map", "q=[", "--out",
                                 c.path("cli/m.safetensors")], "--map", "correct --map q=[")
    case("cli_jacobian_heads_huge", ["analyze", model, "--heads", "2", "--jacobian",
                                     "--jacobian-heads", "0-99999999"], "--jacobian-heads",
         "100 million heads")
    case("cli_correct_layers_huge", ["correct", model, "--heads", "2", "--method", "lambda",
                                     "--layers", "0-50000000", "--out",
                                     c.path("cli/corrected.safetensors")], "--layers",
         "correct with 50 million layers")
    case("cli_lambda_nan", ["analyze", model, "--heads", "2", "--lambda", "nan"], "--lambda",
         "lambda NaN")
    case("cli_tol_negative", ["kappa", *att, "--tol", "-1"], "--tol", "tol -1")
    case("cli_scale_zero", ["kappa", *att, "--scale", "0"], "--scale", "scale 0")
    case("cli_rtol_two", ["kappa", "--matrix", g["X"], "--rtol", "2"], "--rtol", "rtol 2")
    case("cli_heads_zero", ["analyze", model, "--heads", "0"], "--heads", "heads 0")
    case("cli_instances_zero", ["verify", "--instances-per-regime", "0"],
         "--instances-per-regime", "no instances")
    case("cli_instances_huge", ["verify", "--instances-per-regime", "100000000000"],
         "--instances-per-regime", "10^11 instances per regime")
    empty = c.write("cli/X_empty.npy", npy_bytes(np.zeros((0, 8))))
    case("cli_inputs_empty", ["analyze", model, "--heads", "2", "--jacobian", "--inputs", empty],
         "X_empty.npy", "an empty --inputs file, never replaced by synthetic tokens")
    case("cli_out_missing_dir", ["kappa", "--matrix", g["X"], "--out",
                                 c.path("cli/no/such/dir/r.txt")], "r.txt",
         "--out in a directory that does not exist")
    case("cli_unknown_flag", ["kappa", "--matrix", g["X"], "--frobnicate"], "--frobnicate",
         "unknown flag")
    case("cli_x_wrong_shape", ["kappa", "--x", g["X"], "--wq", g["X"], "--wk", g["WK"], "--wv",
                               g["WV"]], "X.npy", "W_Q with the wrong shape")
    rng = np.random.default_rng(9)
    big = {k: c.write(f"cli/{k}_big.npy", npy_bytes(rng.standard_normal(sh)))
           for k, sh in (("X", (200, 400)), ("WQ", (400, 400)), ("WK", (400, 400)),
                         ("WV", (400, 400)))}
    case("cli_jacobian_too_big", ["jacobian", "--x", big["X"], "--wq", big["WQ"], "--wk", big["WK"],
                                  "--wv", big["WV"], "--out", c.path("cli/J_big.npy")],
         "X_big.npy", "J of 80000 x 480000 (307 GB): refused before the allocation")
    case("cli_zero_x", ["kappa", "--x", c.write("cli/X_zero.npy", npy_bytes(np.zeros((4, 3)))),
                        "--wq", g["WQ"], "--wk", g["WK"], "--wv", g["WV"], "--method", "lobpcg"],
         "", "X = 0: J = 0, kappa = inf, never an internal error")
    c.cases[-1]["exit"] = 0
    case("cli_zero_x_iterative", ["kappa", "--x", c.path("cli/X_zero.npy"), "--wq", g["WQ"],
                                  "--wk", g["WK"], "--wv", g["WV"], "--method", "iterative"],
         "", "X = 0 with the iterative method")
    c.cases[-1]["exit"] = 0


def edge_cases(c, g):
    """The numerical edges (docs/cli.md): inputs at the ends of double's range, exact zeros,
    single tokens, and the messages of unusual files. A valid input exits 0 (an answer) or 3 (a
    declined one, with its reason), never 1; a NaN kappa is never a success."""
    rng = np.random.default_rng(11)
    X = rng.standard_normal((6, 8))
    W = {k: rng.standard_normal((8, 4)) / 3 for k in ("WQ", "WK", "WV")}

    def arrays(tag, x, ws):
        p = {"X": c.write(f"edge/{tag}_X.npy", npy_bytes(np.ascontiguousarray(x)))}
        for k, w in ws.items():
            p[k] = c.write(f"edge/{tag}_{k}.npy", npy_bytes(np.ascontiguousarray(w)))
        return ["--x", p["X"], "--wq", p["WQ"], "--wk", p["WK"], "--wv", p["WV"]]

    inputs = {
        "x_denormal": (X * 1e-310, W),
        "x_tiny": (X * 1e-300, W),
        "w_denormal": (X, {k: w * 1e-310 for k, w in W.items()}),
        "w_huge": (X, {"WQ": W["WQ"] * 1e-300, "WK": W["WK"], "WV": W["WV"] * 1e300}),
        "one_token": (X[:1], W),
    }
    for tag, (x, ws) in inputs.items():
        att = arrays(tag, x, ws)
        for m in ("auto", "dense", "gram", "qr", "lobpcg", "iterative", "matfree"):
            c.add(f"edge_{tag}_{m}", "edge", ["kappa", *att, "--method", m, "--format", "json"],
                  "kappa(J)", exit=[0, 3], note=f"{tag}, method {m}: an answer or a decline")
    for tag, scale in (("denormal", 1e-310), ("huge", 1e300), ("zero", 0.0)):
        p = c.write(f"edge/M_{tag}.npy", npy_bytes(rng.standard_normal((5, 4)) * scale))
        c.add(f"edge_matrix_{tag}", "edge", ["kappa", "--matrix", p, "--format", "json"],
              "kappa", exit=[0, 3], note=f"a {tag} matrix: kappa as of a moderate one")
    # Weights near the ends of the range in a checkpoint: analyze and correct.
    for tag, scale in (("denormal", 1e-310), ("huge", 1e300)):
        t = timm(D=8, dtype=np.float64)
        t = {k: (v * scale if k.endswith("weight") else v) for k, v in t.items()}
        p = c.write(f"edge/w_{tag}.safetensors", good_st(t))
        c.add(f"edge_analyze_{tag}", "edge", ["analyze", p, "--heads", "2", "--format", "json"],
              "", exit=[0, 3], note=f"{tag} weights: kappa(W) as of moderate ones")
    # Messages: what is named.
    c.add("edge_unknown_subcommand", "edge", ["frobnicate"], "unknown subcommand 'frobnicate'",
          note="a subcommand that does not exist is named")
    d = c.path("edge/fifo_config")
    os.makedirs(d, exist_ok=True)
    c.write("edge/fifo_config/model.safetensors", good_st())
    fifo = os.path.join(d, "config.json")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    c.add("edge_config_fifo", "edge", ["analyze", d], "config.json",
          note="config.json that is a FIFO is refused by name, never ignored")
    d = c.path("edge/devzero_config")
    os.makedirs(d, exist_ok=True)
    c.write("edge/devzero_config/model.safetensors", good_st())
    link = os.path.join(d, "config.json")
    if not os.path.lexists(link):
        os.symlink("/dev/zero", link)
    c.add("edge_config_dev_zero", "edge", ["analyze", d], "config.json",
          note="config.json linked to /dev/zero is refused by name")
    deep = b'{"__metadata__": ' + b'{"a": ' * 200 + b'"x"' + b'}' * 200 + b'}'
    p = c.write("edge/deep_meta.safetensors", st_bytes(None, raw_json=deep))
    c.add("edge_deep_metadata", "edge", ["analyze", p, "--heads", "2"], "__metadata__",
          note="the nesting limit names where it was reached")
    rep = c.write("edge/overflow_report.json", b'{"checkpoints": [{"kappa": 1e400}]}')
    c.add("edge_merge_overflow", "edge", ["merge", rep], "overflow_report.json",
          note="a number beyond double in a report is refused with the file named")
    model = c.write("edge/model.safetensors", good_st())
    c.add("edge_tokens_too_many", "edge", ["analyze", model, "--heads", "2", "--jacobian",
                                           "--tokens", "65536"], "--tokens 65536",
          note="a --tokens under the cap whose attention cannot fit memory: named, before work")
    c.add("edge_verify_dump_unwritable", "edge",
          ["verify", "--dump", c.path("edge/no/such/dir/dump"), "--instances-per-regime", "1"],
          "--dump", note="a --dump that cannot be made is refused before the sweep")


def build(root):
    c = Corpus(root)
    g = good_npy_set(c)
    os.makedirs(c.path("out"), exist_ok=True)
    npy_cases(c, g)
    npz_cases(c)
    st_cases(c)
    config_cases(c)
    sharded_cases(c)
    pytorch_cases(c)
    unsupported_cases(c)
    cli_cases(c, g)
    edge_cases(c, g)
    ids = [k["id"] for k in c.cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    with open(c.path("manifest.json"), "w") as f:
        json.dump(c.cases, f, indent=1)
    return c.cases


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[0])
        print("usage: make_corpus.py OUTDIR")
        return 2
    cases = build(sys.argv[1])
    by_fmt = {}
    for k in cases:
        by_fmt[k["format"]] = by_fmt.get(k["format"], 0) + 1
    print(f"{len(cases)} cases in {sys.argv[1]}: " +
          ", ".join(f"{f} {n}" for f, n in sorted(by_fmt.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
