"""Small fake CIFAR-10 directories in the standard python-pickle layout (CIFAR-10 is not shipped)."""

from __future__ import annotations

import os
import pickle

import numpy as np


def write_fake_cifar(root: str, per_batch: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write data_batch_1..5, test_batch, batches.meta; returns (train data [5·n, 3072] uint8,
    train labels [5·n])."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    datas, labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        lab = [int(v) for v in rng.integers(0, 10, per_batch)]
        with open(os.path.join(root, name), "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": lab, b"data": data,
                         b"filenames": [b"x.png"] * per_batch}, f)
        if name != "test_batch":
            datas.append(data)
            labels.extend(lab)
    with open(os.path.join(root, "batches.meta"), "wb") as f:
        pickle.dump({b"label_names": [b"c%d" % i for i in range(10)], b"num_cases_per_batch": per_batch,
                     b"num_vis": 3072}, f)
    return np.concatenate(datas), np.array(labels)
