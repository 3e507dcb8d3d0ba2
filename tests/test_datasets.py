"""Datasets: MNIST, Fashion-MNIST (Debian files), CIFAR-10 from a directory, vectorised augmentation."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import crossbow_graph as cg
from crossbow_graph import datasets

from _fake_cifar import write_fake_cifar

needs_fashion = pytest.mark.skipif(
    not os.path.exists(os.path.join(datasets.FASHION_MNIST_DIR, "t10k-images-idx3-ubyte.gz")),
    reason="Debian package dataset-fashion-mnist not installed")


def test_mnist_test_split():
    ds = datasets.mnist(train=False)
    assert ds.images.shape == (10000, 1, 28, 28) and ds.labels.shape == (10000,)
    assert set(ds.labels.tolist()) == set(range(10))
    assert abs(float(ds.images.mean())) < 0.1  # normalised with the training mean/std


@needs_fashion
def test_fashion_mnist_test_split():
    ds = datasets.fashion_mnist(train=False)
    assert ds.images.shape == (10000, 1, 28, 28) and ds.images.dtype == torch.float32
    assert ds.labels.dtype == torch.int64 and set(ds.labels.tolist()) == set(range(10))
    raw = datasets.read_idx(os.path.join(datasets.FASHION_MNIST_DIR, "t10k-images-idx3-ubyte.gz"))
    expected = (torch.from_numpy(raw[:5].astype(np.float32)) / 255 - datasets.FASHION_MNIST_MEAN) \
        / datasets.FASHION_MNIST_STD
    torch.testing.assert_close(ds.images[:5, 0], expected, rtol=1e-6, atol=1e-6)


@needs_fashion
def test_fashion_mnist_padded_rgb_for_resnet():
    plain = datasets.fashion_mnist(train=False)
    ds = datasets.fashion_mnist(train=False, pad_to_32=True, rgb=True)
    assert ds.images.shape == (10000, 3, 32, 32)
    assert ds.images.stride(1) == 0  # the channel is repeated as a view, not copied
    x, y = ds[7]
    assert x.shape == (3, 32, 32) and int(y) == int(plain.labels[7])
    for c in range(3):
        assert torch.equal(x[c, 2:30, 2:30], plain.images[7, 0])
    black = -datasets.FASHION_MNIST_MEAN / datasets.FASHION_MNIST_STD
    assert torch.allclose(x[:, :2], torch.full_like(x[:, :2], black))


def test_fashion_mnist_missing_root_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        datasets.fashion_mnist(root=str(tmp_path))


def test_cifar10_from_a_directory(tmp_path):
    data, labels = write_fake_cifar(str(tmp_path), per_batch=6)
    train = datasets.cifar10(str(tmp_path))
    test = datasets.cifar10(str(tmp_path), train=False)
    assert len(train) == 30 and len(test) == 6
    assert train.images.shape == (30, 3, 32, 32) and torch.equal(train.labels, torch.from_numpy(labels))
    # sample 11: row 11 of the concatenated batches, channel-major 3×32×32, normalised per channel
    raw = torch.from_numpy(data[11].astype(np.float32)).view(3, 32, 32) / 255
    mean = torch.tensor(datasets.CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(datasets.CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(train[11][0], (raw - mean) / std, rtol=1e-6, atol=1e-6)


def _reference_crop_flip(images, pad, top, left, flip, fill):
    """Per-sample Python reference of crop_flip."""
    out = []
    for i in range(len(images)):
        c, h, w = images[i].shape
        padded = fill.view(-1, 1, 1).expand(c, h + 2 * pad, w + 2 * pad).clone()
        padded[:, pad:pad + h, pad:pad + w] = images[i]
        crop = padded[:, top[i]:top[i] + h, left[i]:left[i] + w]
        out.append(crop.flip(-1) if flip[i] else crop)
    return torch.stack(out)


def test_crop_flip_matches_per_sample_reference():
    g = torch.Generator().manual_seed(0)
    images = torch.randn(16, 3, 8, 8, generator=g)
    top, left = torch.randint(0, 9, (16,), generator=g), torch.randint(0, 9, (16,), generator=g)
    flip = torch.rand(16, generator=g) < 0.5
    fill = torch.tensor([-1.0, -2.0, -3.0])
    got = datasets.crop_flip(images, 4, top, left, flip, fill)
    assert torch.equal(got, _reference_crop_flip(images, 4, top, left, flip, fill))
    # offset (p, p) without flip is the identity
    same = datasets.crop_flip(images, 4, torch.full((16,), 4), torch.full((16,), 4),
                              torch.zeros(16, dtype=torch.bool))
    assert torch.equal(same, images)


def test_augmented_batches(tmp_path):
    write_fake_cifar(str(tmp_path), per_batch=6)
    base = datasets.cifar10(str(tmp_path))
    aug = datasets.Augmented(base, padding=4, black=-torch.tensor(datasets.CIFAR10_MEAN)
                             / torch.tensor(datasets.CIFAR10_STD))
    idx = torch.tensor([3, 0, 29, 3])
    torch.manual_seed(0)
    x, y = aug.get_batch(idx)
    assert x.shape == (4, 3, 32, 32) and torch.equal(y, base.labels[idx])
    torch.manual_seed(0)
    assert torch.equal(aug.get_batch(idx)[0], x)  # randomness from torch's (checkpointed) RNG
    assert not torch.equal(aug.get_batch(idx)[0], x)
    # every augmented image is one of the 9 × 9 × 2 crops/flips of its source, padded with black
    black = aug.fill
    for i, j in enumerate(idx.tolist()):
        candidates = [_reference_crop_flip(base.images[j:j + 1], 4, [t], [l], [f], black)[0]
                      for t in range(9) for l in range(9) for f in (False, True)]  # noqa: E741
        assert any(torch.equal(x[i], c) for c in candidates)


def test_fit_uses_the_vectorised_batch_path(tmp_path):
    write_fake_cifar(str(tmp_path), per_batch=8)
    base = datasets.cifar10(str(tmp_path))

    class Counting(datasets.Augmented):
        calls = 0

        def get_batch(self, indices):
            Counting.calls += 1
            return super().get_batch(indices)

        def __getitem__(self, i):
            raise AssertionError("fit must not read samples one by one")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    plan = cg.compile(model, (base[0][0].unsqueeze(0),), nn.functional.cross_entropy, batch_size=4,
                      devices=1, replicas=2, executor="inline")  # worker processes count in their own copy
    plan.fit(Counting(base), 1, progress=False)
    assert Counting.calls == 1 + 5  # the first-batch check, then one call per round (40 / 8)


def test_dataloader_and_any_dataset_are_accepted():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    model = nn.Linear(4, 3)
    a = cg.compile(model, (torch.zeros(1, 4),), nn.functional.cross_entropy, batch_size=4)
    b = cg.compile(model, (torch.zeros(1, 4),), nn.functional.cross_entropy, batch_size=4)
    a.fit(ds, 1, progress=False, shuffle=False)
    b.fit(DataLoader(ds, batch_size=7), 1, progress=False, shuffle=False)
    assert torch.equal(a.central_weights(), b.central_weights())


@needs_fashion
def test_cli_gives_cifar_style_models_padded_rgb_fashion_mnist(monkeypatch):
    import argparse

    from crossbow_graph import cli_train, models

    monkeypatch.setattr(models, "INPUT_SHAPES", {"resnet32": (3, 32, 32)}, raising=False)
    args = argparse.Namespace(dataset="fashion_mnist", data_dir=None, model="resnet32",
                              train_samples=64, test_samples=32, no_augment=False)
    train, test = cli_train.load_dataset(args)
    assert train.images.shape == (64, 3, 32, 32) and test.images.shape == (32, 3, 32, 32)
    args.model = "lenet5"
    assert cli_train.load_dataset(args)[0].images.shape == (64, 1, 28, 28)


needs_fortunes = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(datasets.FORTUNES_DIR, f)) for f in datasets.FORTUNES_FILES),
    reason="Debian packages fortunes and fortunes-min not installed (bash scripts/setup.sh installs "
           "them: apt-get install fortunes fortunes-min)")


def _cookies_of(ds: datasets.TextDataset) -> list[bytes]:
    """The cookies of a split's stream, which ends every cookie with "\\n%\\n"."""
    stream = bytes(ds.tokens.tolist())
    assert stream.endswith(b"\n%\n")
    return stream[:-3].split(b"\n%\n")


@needs_fortunes
def test_fortunes_is_split_by_cookie_into_windows_of_bytes():
    """Debian 12's fortunes 1:1.99.1-7.3 and fortunes-min: 15,217 cookies of 2,531,016 bytes."""
    cookies = datasets.read_cookies()
    assert len(cookies) == 15_217 and sum(map(len, cookies)) == 2_531_016
    train, val = datasets.fortunes("train"), datasets.fortunes("val")
    train_cookies, val_cookies = _cookies_of(train), _cookies_of(val)
    assert (len(train_cookies), len(val_cookies)) == (13_703, 1_514)
    assert not set(train_cookies) & set(val_cookies)  # repeated cookies share their split
    assert sorted(train_cookies + val_cookies) == sorted(cookies)
    assert [c for c in cookies if c in set(val_cookies)] == val_cookies  # in file order
    assert (len(train.tokens), len(val.tokens)) == (2_306_085, 270_582)
    assert (len(train), len(val)) == (18_016, 2_113) and train.num_tokens == 18_016 * 128
    assert isinstance(train, TensorDataset) and train.vocab_size == 256
    x, y = train[5]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (128,)
    assert torch.equal(x, train.tokens[640:768]) and torch.equal(y, train.tokens[641:769])
    assert int(train.tokens.min()) >= 0 and int(train.tokens.max()) < 256
    first = train_cookies[0]
    assert train.decode(train.tokens[:3 + len(first)]) == first.decode("utf-8", "replace") + "\n%\n"
    again = datasets.fortunes("val")
    assert torch.equal(again.tokens, val.tokens)
    other = datasets.fortunes("val", seed=1)
    assert not torch.equal(other.tokens, val.tokens)
    assert 0.08 < len(_cookies_of(other)) / len(cookies) < 0.12


@needs_fortunes
def test_fortunes_block_size_subset_and_text_round_trip():
    val = datasets.fortunes("val", block_size=16)
    assert len(val) == (270_582 - 1) // 16 and val.tensors[0].shape == (len(val), 16)
    part = val.subset(4)
    picks = [i * len(val) // 4 for i in range(4)]
    assert len(part) == 4 and part.block_size == 16
    for row, i in enumerate(picks):
        assert torch.equal(part[row][0], val[i][0]) and torch.equal(part[row][1], val[i][1])
    assert len(val.subset(10**6)) == len(val)
    text = "Naïve %\n\tquote"
    assert datasets.TextDataset.decode(datasets.TextDataset.encode(text)) == text
    assert datasets.TextDataset.encode("é").tolist() == [0xC3, 0xA9]


def test_fortunes_missing_files_name_the_packages(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"lacks 43 of its 43 .*apt-get install fortunes fortunes-min"):
        datasets.fortunes(root=str(tmp_path))
    for name in ("fortunes", "literature", "riddles"):  # fortunes-min alone
        (tmp_path / name).write_text("A cookie.\n%\n")
    with pytest.raises(FileNotFoundError, match=r"lacks 40 of its 43 cookie files .*\(art, ascii-art, computers, …\)"):
        datasets.fortunes(root=str(tmp_path))


def test_fortunes_reads_cookie_files_of_any_layout(tmp_path):
    for name in datasets.FORTUNES_FILES:
        (tmp_path / name).write_text("")
    (tmp_path / "art").write_text("%\nfirst\n%\n  \n%\nsecond\nline\n%\n%% not a separator\n")
    (tmp_path / "zippy").write_text("last, no separator\n")
    assert datasets.read_cookies(str(tmp_path)) == [b"first", b"second\nline", b"%% not a separator",
                                                    b"last, no separator"]
    train = datasets.fortunes("train", block_size=4, val_per_mille=1, root=str(tmp_path))
    assert train.decode(train.tokens) == "first\n%\nsecond\nline\n%\n%% not a separator\n%\nlast, no separator\n%\n"


@pytest.mark.parametrize("kwargs, match", [
    (dict(split="test"), r"splits are 'train' and 'val'"),
    (dict(block_size=0), r"block_size=0.*integer ≥ 1"),
    (dict(val_per_mille=1000), r"val_per_mille=1000.*1 … 999"),
])
def test_fortunes_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        datasets.fortunes(**kwargs)
