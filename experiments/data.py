"""The experiment's data, both on the machine already (no download): scikit-learn's bundled
8 x 8 digits, and a character corpus made of the licence texts every Debian system ships.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch

CORPUS_DIR = "/usr/share/common-licenses"


@dataclass
class Digits:
    """A fixed stratified train/test split of the 1,797 digits (pixels scaled to [0, 1])."""

    train_x: torch.Tensor  # n x 8 x 8, float32
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    source: str


def digits(test_fraction: float = 0.2, split_seed: int = 0) -> Digits:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.images.astype(np.float32) / 16.0
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(split_seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):  # stratified: the same fraction of every class held out
        idx = np.flatnonzero(y == c)
        test[rng.choice(idx, size=int(round(test_fraction * len(idx))), replace=False)] = True
    t = torch.from_numpy
    return Digits(t(x[~test]), t(y[~test]), t(x[test]), t(y[test]),
                  f"sklearn.datasets.load_digits: {len(y)} images, {int(test.sum())} held out")


@dataclass
class Corpus:
    """Character ids of a training and a held-out text, and the vocabulary."""

    train: torch.Tensor  # int64 ids
    valid: torch.Tensor
    vocab: List[str]
    source: str
    sha256: str


def corpus(directory: str = CORPUS_DIR, valid_fraction: float = 0.1) -> Corpus:
    """Every regular file of `directory` (symbolic links skipped, so no text counts twice), in
    name order; the last `valid_fraction` of each file is held out."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"corpus: {directory} is not a directory")
    names = sorted(n for n in os.listdir(directory)
                   if os.path.isfile(os.path.join(directory, n))
                   and not os.path.islink(os.path.join(directory, n)))
    if not names:
        raise FileNotFoundError(f"corpus: {directory} holds no regular file")
    train_parts, valid_parts = [], []
    h = hashlib.sha256()
    for n in names:
        with open(os.path.join(directory, n), "rb") as f:
            raw = f.read()
        h.update(n.encode() + b"\0" + raw)
        text = raw.decode("utf-8", errors="replace")
        cut = int(len(text) * (1 - valid_fraction))
        train_parts.append(text[:cut])
        valid_parts.append(text[cut:])
    train_text, valid_text = "\n".join(train_parts), "\n".join(valid_parts)
    vocab = sorted(set(train_text) | set(valid_text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = lambda s: torch.tensor([index[c] for c in s], dtype=torch.int64)
    return Corpus(ids(train_text), ids(valid_text), vocab,
                  f"{directory}: {len(names)} files, {len(train_text)} + {len(valid_text)} "
                  f"characters, vocabulary {len(vocab)}", h.hexdigest())


def windows(ids: torch.Tensor, context: int, limit: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Up to `limit` non-overlapping (input, next-character target) windows from the start."""
    n = min(limit, (len(ids) - 1) // context)
    if n < 1:
        raise ValueError(f"windows: {len(ids)} characters are too few for context {context}")
    x = ids[: n * context].reshape(n, context)
    y = ids[1: n * context + 1].reshape(n, context)
    return x, y
