"""The experiment's data, all on the machine already or generated (no download): scikit-learn's
bundled 8 x 8 digits, a procedurally generated 8 x 8 shapes task (numpy, from a seed), and a
character corpus made of the licence texts every Debian system ships. Learning rates are chosen
on validation splits carved from the training data (validation_split, corpus_validation), never
on the test split.
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


SHAPES = ("horizontal bar", "vertical bar", "diagonal", "anti-diagonal", "square outline",
          "filled square", "plus", "cross")


def _shape(kind: int, rng: np.random.Generator, side: int) -> np.ndarray:
    """One shape of class `kind` at a random size and position, intensity in [0.5, 1]."""
    img = np.zeros((side, side), np.float32)
    v = rng.uniform(0.5, 1.0)
    n = int(rng.integers(3, side - 1))  # the shape's extent: 3 .. side - 2 pixels
    r, c = (int(x) for x in rng.integers(0, side - n + 1, size=2))
    k = np.arange(n)
    if kind == 0:
        img[r + n // 2, c:c + n] = v
    elif kind == 1:
        img[r:r + n, c + n // 2] = v
    elif kind == 2:
        img[r + k, c + k] = v
    elif kind == 3:
        img[r + k, c + n - 1 - k] = v
    elif kind == 4:
        img[r, c:c + n] = img[r + n - 1, c:c + n] = v
        img[r:r + n, c] = img[r:r + n, c + n - 1] = v
    elif kind == 5:
        img[r:r + n, c:c + n] = v
    elif kind == 6:
        img[r + n // 2, c:c + n] = v
        img[r:r + n, c + n // 2] = v
    else:
        img[r + k, c + k] = v
        img[r + k, c + n - 1 - k] = v
    return img


def shapes(train: int = 1600, test: int = 800, noise: float = 0.25, side: int = 8,
           seed: int = 0) -> Digits:
    """A procedurally generated vision task (no file, no network): 8 x 8 images of one of eight
    shapes (SHAPES) at a random size (3 to 6 pixels) and position, with Gaussian pixel noise of
    standard deviation `noise`, clipped to [0, 1]; balanced classes. The test images come from
    a generator of their own (seed + 1), so no image is shared with training."""
    def make(count: int, s: int):
        rng = np.random.default_rng(s)
        y = np.arange(count) % len(SHAPES)
        rng.shuffle(y)
        x = np.stack([_shape(int(k), rng, side) for k in y])
        x = np.clip(x + rng.normal(0.0, noise, x.shape).astype(np.float32), 0.0, 1.0)
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))

    tx, ty = make(train, 2 * seed)
    vx, vy = make(test, 2 * seed + 1)
    return Digits(tx, ty, vx, vy, f"experiments/data.py shapes: {len(SHAPES)} classes, {train} "
                                  f"training and {test} test images of {side} x {side}, noise "
                                  f"{noise}, seed {seed} (generated, no download)")


def validation_split(data: Digits, fraction: float = 0.2, seed: int = 1) -> Digits:
    """The training images split into a smaller training set and a validation set (stratified:
    `fraction` of every class): what learning rates are chosen on. The test split is dropped."""
    y = data.train_y.numpy()
    rng = np.random.default_rng(seed)
    valid = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        valid[rng.choice(idx, size=int(round(fraction * len(idx))), replace=False)] = True
    keep, held = torch.from_numpy(~valid), torch.from_numpy(valid)
    return Digits(data.train_x[keep], data.train_y[keep], data.train_x[held], data.train_y[held],
                  f"{data.source}; validation: {int(valid.sum())} of the {len(y)} training "
                  f"images (stratified, seed {seed})")


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


def corpus_validation(text: Corpus, fraction: float = 0.1) -> Corpus:
    """The training ids split into a smaller training text and a validation text (its last
    `fraction`): what learning rates are chosen on. The held-out text is dropped."""
    cut = int(len(text.train) * (1 - fraction))
    return Corpus(text.train[:cut], text.train[cut:], text.vocab,
                  f"{text.source}; validation: the last {len(text.train) - cut} training "
                  f"characters", text.sha256)


def windows(ids: torch.Tensor, context: int, limit: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Up to `limit` non-overlapping (input, next-character target) windows from the start."""
    n = min(limit, (len(ids) - 1) // context)
    if n < 1:
        raise ValueError(f"windows: {len(ids)} characters are too few for context {context}")
    x = ids[: n * context].reshape(n, context)
    y = ids[1: n * context + 1].reshape(n, context)
    return x, y
