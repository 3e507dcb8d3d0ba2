"""torchft's DiLoCo as an independent oracle for ``sync=DiLoCo(...)`` (docs/distributed.md,
"Fault tolerance: torchft's DiLoCo as an oracle").

k replica groups of torchft (one Manager each, a reconfigurable gloo process group, a Lighthouse
in this process, one thread per group) run ``torchft.local_sgd.DiLoCo`` over the same model,
inner AdamW, H and outer Nesterov SGD as one crossbow_graph plan with k learners, replica j taking
batch t·k + j of round t; z of both must agree to float32 summation order. Skipped without
torchft (the ``ft`` extra)."""

from __future__ import annotations

import copy
import threading
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import crossbow_graph as cg

torchft = pytest.importorskip("torchft", reason="torchft is the 'ft' extra: pip install crossbow_graph[ft]")
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.local_sgd import DiLoCo as TorchftDiLoCo  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from _reference import flat  # noqa: E402
from test_diloco import NESTEROV, Small, _data  # noqa: E402

pytestmark = pytest.mark.distributed

K, B, H, ROUNDS = 3, 4, 4, 12
LR, WD = 3e-3, 0.01


def _torchft_group(j: int, model: nn.Module, data: TensorDataset, lighthouse: str,
                   out: dict[int, torch.Tensor]) -> None:
    """Replica group j of torchft's DiLoCo: one process (rank 0 of 1) with its own TCPStore."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = copy.deepcopy(model)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    outer = NESTEROV(model.parameters())
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=K,
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        use_async_quorum=False,  # DiLoCo's requirement
        init_sync=False,  # True would copy the first group's whole state (trained w, AdamW) at step 0
        replica_id=f"oracle{j}", store_addr="127.0.0.1", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30))
    x, y = data.tensors
    try:
        with TorchftDiLoCo(manager, [model], inner, outer, sync_every=H, pin_memory=False):
            for t in range(ROUNDS):
                sl = slice((t * K + j) * B, (t * K + j + 1) * B)
                inner.zero_grad()
                F.cross_entropy(model(x[sl]), y[sl]).backward()
                inner.step()  # every H-th step: the pseudo-gradient all-reduce and the outer step
        assert manager.current_step() == ROUNDS // H, "a sync was not committed"
        out[j] = flat(model)
    finally:
        manager.shutdown(wait=False)


def test_diloco_matches_torchfts_diloco_over_k_replica_groups():
    """k = 3 learners (1 device × 3 replicas) against 3 torchft replica groups, b = 4, inner
    AdamW(lr 3e-3, wd 0.01), H = 4, outer SGD(lr 0.7, momentum 0.9, Nesterov), 12 rounds (three
    outer steps): z within rtol 1e-5, atol 1e-6 of torchft's (float32; Σ(w − z)/−k here, the
    mean of (z − w) there), and every torchft group holds the same model bit for bit."""
    torch.manual_seed(0)
    model, data = Small(), _data(K * B * ROUNDS)
    plan = cg.compile(model, (torch.zeros(1, 1, 8, 8),), F.cross_entropy, batch_size=B,
                      devices=1, replicas=K,
                      optimizer=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
                      sync=cg.DiLoCo(sync_every=H, outer_optimizer=NESTEROV))
    start = copy.deepcopy(model)  # the fit leaves z in model
    plan.fit(data, 1, shuffle=False, progress=False, metrics_every=None)
    assert plan.rounds_done == ROUNDS

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=K)
    out: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(j: int) -> None:
        try:
            _torchft_group(j, start, data, lighthouse.address(), out)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(K)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
    finally:
        lighthouse.shutdown()
    assert not errors, errors
    assert sorted(out) == list(range(K)), "a torchft group did not finish within 120 s"
    for j in range(1, K):
        assert torch.equal(out[j], out[0])
    got = plan.central_weights()
    torch.testing.assert_close(got, out[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, flat(start), atol=1e-3)  # it trained
