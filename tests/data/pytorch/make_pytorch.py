#!/usr/bin/env python3
"""Writes the PyTorch checkpoints tests/test_pytorch.cpp reads, with torch.save itself, and the
float64 values numpy computes from the same tensors (reference.npz). Run with a Python that has
torch (scripts/setup-python makes .venv-py):

    .venv-py/bin/python tests/data/pytorch/make_pytorch.py
"""
import argparse
import collections
import os

import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))


def state_dict():
    g = torch.Generator().manual_seed(0)
    sd = collections.OrderedDict()
    sd["attn.query.weight"] = torch.randn(4, 6, generator=g)
    sd["attn.key.weight"] = torch.randn(6, 4, generator=g).t()  # a transposed view: strided
    sd["attn.value.weight"] = torch.randn(4, 6, generator=g).half()
    sd["attn.out.weight"] = torch.randn(3, 5, generator=g).bfloat16()
    sd["position_ids"] = torch.arange(7)
    fused = torch.randn(12, 4, generator=g)
    # Three views of one storage, at offsets 0, 16 and 32.
    sd["fused.q"], sd["fused.k"], sd["fused.v"] = fused[0:4], fused[4:8], fused[8:12]
    sd["double"] = torch.randn(2, 3, generator=g, dtype=torch.float64)
    sd["bias"] = torch.randn(6, generator=g)
    return sd


def attention_models():
    """Small attention checkpoints in three layouts, for the CLI tests (tests/python): each is
    saved by torch and, with the same values and dtypes, by numpy as an .npz."""
    g = torch.Generator().manual_seed(1)
    D = 8
    mha = collections.OrderedDict()
    for i in range(2):
        mha[f"layers.{i}.self_attn.in_proj_weight"] = torch.randn(3 * D, D, generator=g) * 0.3
        mha[f"layers.{i}.self_attn.in_proj_bias"] = torch.randn(3 * D, generator=g)
        mha[f"layers.{i}.self_attn.out_proj.weight"] = torch.randn(D, D, generator=g)
    bert = collections.OrderedDict()
    for i in range(2):
        for p in ("query", "key", "value"):
            bert[f"encoder.layer.{i}.attention.self.{p}.weight"] = torch.randn(D, D, generator=g)
            bert[f"encoder.layer.{i}.attention.self.{p}.bias"] = torch.randn(D, generator=g)
    llama = collections.OrderedDict()
    for i in range(2):  # 4 query heads, 2 key/value heads of width 2, in float16
        a = f"model.layers.{i}.self_attn."
        llama[a + "q_proj.weight"] = (torch.randn(D, D, generator=g) * 0.3).half()
        llama[a + "k_proj.weight"] = (torch.randn(4, D, generator=g) * 0.3).half()
        llama[a + "v_proj.weight"] = (torch.randn(4, D, generator=g) * 0.3).half()
    return {"mha_zip": (mha, True), "bert_legacy": (bert, False), "llama_f16": (llama, True)}


def main():
    for name, (sd, zipped) in attention_models().items():
        torch.save(sd, os.path.join(here, name + ".bin"), _use_new_zipfile_serialization=zipped)
        np.savez(os.path.join(here, name + ".npz"), **{k: v.numpy() for k, v in sd.items()})
    sd = state_dict()
    torch.save(sd, os.path.join(here, "zip.pt"))
    torch.save(sd, os.path.join(here, "legacy.pt"), _use_new_zipfile_serialization=False)
    # A training checkpoint: the state dict under "model", an nn.Parameter, and objects that are
    # not tensors (an argparse.Namespace, ints, strings), which the reader must pass over.
    ckpt = {"model": sd, "epoch": 3, "args": argparse.Namespace(lr=0.1, name="run"),
            "extra": [torch.ones(2, 2), {"w": torch.nn.Parameter(torch.full((2, 3), 0.5))}]}
    torch.save(ckpt, os.path.join(here, "training.pt"))
    ref = {k: v.to(torch.float64).numpy() for k, v in sd.items() if v.is_floating_point()}
    np.savez(os.path.join(here, "reference.npz"), **ref)


if __name__ == "__main__":
    main()
