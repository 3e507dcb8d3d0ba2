"""Writes this fixture with a checkout that writes checkpoint format 1 (its tests/test_checkpoint.py
make_plan, the same plan as net_plan here): a checkpoint of that plan stopped at round 4 of 12 (ckpt/),
and the z, w, v and buffers of the same fit uninterrupted (expected.pt).

    PYTHONPATH=CHECKOUT python tests/data/checkpoint_v1/make.py OUT_DIR
"""
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from test_checkpoint import StopAfter, data, make_plan  # noqa: E402

from crossbow_graph.training.checkpoint import list_checkpoints  # noqa: E402

out = sys.argv[1]
full = make_plan()
full.fit(data(), 2, progress=False, seed=3)
torch.save({f"{d}.{k}": getattr(s, k).clone() for d, s in enumerate(full.states)
            for k in ("z", "z_prev", "w", "v", "buf", "zbuf")}, os.path.join(out, "expected.pt"))
ckpt = os.path.join(out, "ckpt")
shutil.rmtree(ckpt, ignore_errors=True)
make_plan().fit(data(), 2, progress=False, hooks=[StopAfter(4)], seed=3, checkpoint_dir=ckpt,
                checkpoint_every=4)
print(list_checkpoints(ckpt))
