"""Arrays as people hold them, handed to the C++ library without copies where the layout allows.

numpy arrays pass through unchanged (float32 or float64, C or Fortran order; the binding reads a
Fortran-order array in place and copies a C-order one once into the library's column-major
storage). PyTorch CPU tensors become numpy views of the same memory (detached, read-only), also
for tensors that require grad. CUDA (or any non-CPU) tensors are refused with an error naming the
argument and its device. Other sequences go through numpy.asarray as float64. Every remaining
check (rank, dtype, layout, NaN) is made by the binding, with the library's message.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _torch():
    import sys

    return sys.modules.get("torch")  # never import torch just to check a type


def as_array(name: str, x: Any, fn: str) -> Any:
    """The object to pass to the binding for argument `name` of function `fn`."""
    if isinstance(x, np.ndarray):
        return x
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"{fn}: {name} is a tensor on {x.device}; this build computes on the CPU only: "
                f"pass {name}.cpu()"
            )
        if x.layout != torch.strided:
            raise TypeError(f"{fn}: {name} must be a dense (strided) tensor (got {x.layout})")
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{fn}: {name} must be float32 or float64 (got {x.dtype})")
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        view = x.detach().numpy()  # shares memory with the tensor
        view.flags.writeable = False
        return view
    if hasattr(x, "__array__") or hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__"):
        return np.asarray(x)
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.float64)
    raise TypeError(f"{fn}: {name} must be an array (numpy, a torch tensor, or a nested list)")


def as_optional_array(name: str, x: Any, fn: str) -> Any:
    return None if x is None else as_array(name, x, fn)


def as_mask(x: Any, fn: str) -> Any:
    if x is None or isinstance(x, str):
        return x
    return as_array("mask", x, fn)


def as_extras(fn: str, biases: Any, rope: Any) -> Any:
    """The biases and RoPE of an attention call (MATH.md §10) as the binding reads them.

    biases: None or (b_Q, b_K, b_V), each a vector or None. rope: None, a pairing name
    ('rotate_half' or 'interleaved') or a spectral_cond.Rope.
    """
    if biases is None and rope is None:
        return None
    out: dict = {}
    if biases is not None:
        if not isinstance(biases, (tuple, list)) or len(biases) != 3:
            raise TypeError(f"{fn}: biases must be a tuple (b_Q, b_K, b_V), each a vector or None")
        for key, b in zip(("bias_q", "bias_k", "bias_v"), biases):
            if b is None:
                out[key] = None
                continue
            a = as_array(key, b, fn)
            if a.ndim != 1:
                raise ValueError(f"{fn}: {key} must be a vector (got shape {tuple(a.shape)})")
            out[key] = a.reshape(-1, 1)
    if rope is not None:
        if isinstance(rope, str):
            out["rope"] = (rope, 10000.0, 0, 0)
        elif all(hasattr(rope, k) for k in ("pairing", "theta", "dims", "offset")):
            cos, sin = getattr(rope, "cos", None), getattr(rope, "sin", None)
            if (cos is None) != (sin is None):
                raise ValueError(f"{fn}: rope cos and sin tables must be given together")
            tables = (None, None) if cos is None else (as_array("rope cos", cos, fn),
                                                         as_array("rope sin", sin, fn))
            out["rope"] = (str(rope.pairing), float(rope.theta), int(rope.dims),
                           int(rope.offset)) + tables
        else:
            raise TypeError(f"{fn}: rope must be None, 'rotate_half', 'interleaved' or a Rope")
    return out
