#!/usr/bin/env python3
"""Writes the GGUF fixtures of tests/test_gguf.cpp with the PyPI package `gguf` (gguf-py,
llama.cpp's own Python writer and quantizer), and beside each tensor the reference values as
float64 .npy files.

    python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf numpy
    /tmp/gguf-venv/bin/python tests/data/gguf/make_gguf.py

Files (all small, deterministic for a given gguf and numpy version):
  floats.gguf    F32, F16, BF16, F64 tensors of known values (2-D and one 3-D) and metadata of
                 every value type, general.alignment = 64.
                 floats.<tensor>.npy: the values (gguf.quants.dequantize where it handles the
                 type; F64 is stored as is).
  quants.gguf    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 quantized by gguf.quants.quantize from Gaussian
                 data; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and Q8_K as random blocks whose scale fields
                 are overwritten with finite, modest values (gguf-py cannot quantize them).
                 quants.<tensor>.npy: gguf.quants.dequantize of the stored bytes (float32 there,
                 widened to float64 exactly); for Q8_K, which gguf-py cannot dequantize,
                 d * q computed here in float64.
  llama.gguf     architecture "llama", llama.attention.head_count = 4, head_count_kv = 2;
                 blk.0.attn_q.weight (16 x 16) and blk.0.attn_k.weight (8 x 16) permuted as
                 llama.cpp's convert_hf_to_gguf.py permutes them, blk.0.attn_v.weight not.
                 llama.attn_q.orig.npy, llama.attn_k.orig.npy: the weights before permuting.
  bigendian.gguf a big-endian file (gguf-py's GGUFEndian.BIG), which the reader refuses.
"""

import importlib.metadata
import os
import struct

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

HERE = os.path.dirname(os.path.abspath(__file__))


def path(name):
    return os.path.join(HERE, name)


def save_ref(prefix, tensor, values):
    assert np.all(np.isfinite(values)), (prefix, tensor)
    np.save(path(f"{prefix}.{tensor}.npy"), np.asarray(values, dtype=np.float64))


def write(writer, filename):
    writer.write_header_to_file(path(filename))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized(raw_bytes, qtype, shape):
    """gguf-py's dequantization of stored bytes, as float64 of the tensor's shape."""
    return gguf.quants.dequantize(raw_bytes, qtype).astype(np.float64).reshape(shape)


def floats():
    w = gguf.GGUFWriter(path("floats.gguf"), "test")
    w.add_custom_alignment(64)
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "hello, gguf")
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", -1.5e300)
    w.add_array("test.array_i32", [1, -2, 3])
    w.add_array("test.array_str", ["a", "bc", ""])
    w.add_key_value("test.array_nested", [[1, 2], [3]], V.ARRAY, sub_type=V.ARRAY)

    f32 = (np.arange(15, dtype=np.float32).reshape(3, 5) - 7) / np.float32(8)
    f32[2, 4] = np.float32(1e-30)
    w.add_tensor("f32", f32)
    save_ref("floats", "f32", dequantized(f32.view(np.uint8), T.F32, f32.shape))

    f16 = np.array([[0.5, -1, 65504, 2**-24, 0, -0.0, 1 / 3, 1e-5]] * 4, dtype=np.float16)
    f16[1] *= np.float16(0.5)
    f16[3] = -f16[3]
    w.add_tensor("f16", f16)
    save_ref("floats", "f16", dequantized(f16.view(np.uint8), T.F16, f16.shape))

    src = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)
    src[0, 0] = np.float32(1e38)
    bf16 = gguf.quants.quantize(src, T.BF16)  # uint8 bytes, shape (2, 32)
    w.add_tensor("bf16", bf16, raw_dtype=T.BF16)
    save_ref("floats", "bf16", dequantized(bf16, T.BF16, (2, 16)))

    f64 = np.array([[1 / 3, -2.5, 1e-300], [7.0, 2**60, -0.0]], dtype=np.float64)
    w.add_tensor("f64", f64)
    save_ref("floats", "f64", f64)  # gguf.quants.dequantize has no F64 branch: the values

    f3 = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * np.float32(0.5)
    w.add_tensor("f32_3d", f3)
    save_ref("floats", "f32_3d", dequantized(f3.view(np.uint8), T.F32, f3.shape))
    write(w, "floats.gguf")


# Byte offsets and kinds of the scale fields of each K-quant block, overwritten after the
# random fill so that every scale is finite and modest (random bytes would give huge halves,
# infinities and NaNs).
K_SCALES = {
    T.Q2_K: [(80, "f16"), (82, "f16")],
    T.Q3_K: [(108, "f16")],
    T.Q4_K: [(0, "f16"), (2, "f16")],
    T.Q5_K: [(0, "f16"), (2, "f16")],
    T.Q6_K: [(208, "f16")],
    T.Q8_K: [(0, "f32")],
}


def quants():
    rng = np.random.default_rng(20240601)
    w = gguf.GGUFWriter(path("quants.gguf"), "test")
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        data = (rng.standard_normal((4, 64)) * 0.05).astype(np.float32)
        data[3, :32] = np.float32(0.01)  # a constant block (Q4_1 / Q5_1: d = 0)
        data[3, 32:] = 0  # an all-zero block (d = 0)
        q = gguf.quants.quantize(data, qtype)
        name = qtype.name.lower()
        w.add_tensor(name, q, raw_dtype=qtype)
        save_ref("quants", name, dequantized(q, qtype, data.shape))

    shape = (3, 256)
    for qtype, fields in K_SCALES.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = shape[0] * shape[1] // block_size
        raw = rng.integers(0, 256, size=(blocks, type_size), dtype=np.uint8)
        for off, kind in fields:
            if kind == "f16":
                vals = rng.uniform(-0.05, 0.05, size=blocks).astype(np.float16)
                raw[:, off:off + 2] = vals.view(np.uint8).reshape(blocks, 2)
            else:
                vals = rng.uniform(1e-4, 1e-2, size=blocks).astype(np.float32)
                raw[:, off:off + 4] = vals.view(np.uint8).reshape(blocks, 4)
        raw = raw.reshape(shape[0], -1)
        name = qtype.name.lower()
        w.add_tensor(name, raw, raw_dtype=qtype)
        if qtype == T.Q8_K:
            # gguf-py has no Q8_K dequantizer: float32 d, 256 int8 q, 16 int16 sums; y = d q.
            b = raw.reshape(blocks, type_size)
            d = b[:, 0:4].copy().view(np.float32).astype(np.float64)
            q = b[:, 4:260].copy().view(np.int8).astype(np.float64)
            save_ref("quants", name, (d * q).reshape(shape))
        else:
            save_ref("quants", name, dequantized(raw, qtype, shape))
    write(w, "quants.gguf")


def rope_permute(w, n_head):
    """The row order llama.cpp's converter writes for Q and K of "llama" models:
    reshape (n_head, 2, d/2, cols), swap the two middle axes, reshape back."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama():
    rng = np.random.default_rng(7)
    n_embd, n_head, n_head_kv = 16, 4, 2
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(path("llama.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(n_embd)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    wq = rng.standard_normal((n_embd, n_embd)).astype(np.float32)
    wk = rng.standard_normal((n_head_kv * head_dim, n_embd)).astype(np.float32)
    wv = rng.standard_normal((n_head_kv * head_dim, n_embd)).astype(np.float32)
    # The converter permutes K with n_head_kv heads (it replaces n_head by n_head_kv).
    w.add_tensor("blk.0.attn_q.weight", rope_permute(wq, n_head))
    w.add_tensor("blk.0.attn_k.weight", rope_permute(wk, n_head_kv))
    w.add_tensor("blk.0.attn_v.weight", wv)
    np.save(path("llama.attn_q.orig.npy"), wq.astype(np.float64))
    np.save(path("llama.attn_k.orig.npy"), wk.astype(np.float64))
    write(w, "llama.gguf")


def bigendian():
    w = gguf.GGUFWriter(path("bigendian.gguf"), "test", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("test.u32", 7)
    w.add_tensor("w", np.arange(4, dtype=np.float32).reshape(2, 2))
    write(w, "bigendian.gguf")
    with open(path("bigendian.gguf"), "rb") as f:
        head = f.read(8)
    assert head[:4] == b"GGUF" and struct.unpack(">I", head[4:8])[0] == 3


if __name__ == "__main__":
    floats()
    quants()
    llama()
    bigendian()
    total = sum(os.path.getsize(path(f)) for f in os.listdir(HERE))
    print(f"gguf {importlib.metadata.version('gguf')}, numpy {np.__version__}: fixtures written to {HERE}, {total} bytes in all")
