"""Padded rows (engine/state/flat.py ``row_length``): on CUDA devices the rows of w, v, g, w_model are
``[:, :P]`` views of ``[m, P_pad]`` buffers, P_pad a multiple of 32. No CUDA device here: the
kernel runs on padded CPU views in Triton's interpreter, and the state's padding is forced on
the CPU through its private knob. The oracle is the torch implementation on contiguous rows;
every pad column holds a sentinel that must survive, unwritten, and the results must not
change (nothing reads it).
"""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import crossbow_graph as cg
from crossbow_graph.engine.state import flat as state_module
from crossbow_graph.kernels import triton_sma as K
from crossbow_graph.kernels.torch_ref import sma_local_update

from _plans import make_plan

ATOL, RTOL = 1e-6, 1e-5  # as tests/test_kernels.py: the interpreter rounds a·b + c twice
SENTINEL = -3.5  # exact in every dtype; a write changes it, a read changes the results


def padded(t: torch.Tensor, P_pad: int) -> torch.Tensor:
    """``t [m, P]`` copied into the ``[:, :P]`` view of an ``[m, P_pad]`` tensor whose pad
    columns hold the sentinel."""
    m, P = t.shape
    full = torch.full((m, P_pad), SENTINEL, dtype=t.dtype)
    full[:, :P] = t
    return full[:, :P]


def pad_columns(view: torch.Tensor) -> torch.Tensor:
    """The pad columns ``[m, P_pad − P]`` behind a ``[:, :P]`` view."""
    m, P = view.shape
    stride = view.stride(0)
    return view.as_strided((m, stride), (stride, 1))[:, P:]


@pytest.mark.parametrize("m,P,block,dtype", [(3, 130, 64, torch.float32),
                                             (12, 61, 16, torch.bfloat16),  # runtime row loop
                                             (2, 200, None, torch.float16)])
def test_kernel_on_padded_rows_matches_torch_and_leaves_the_pad(m, P, block, dtype):
    """(a) The interpreted local kernel on ``[:, :P]`` views of ``[m, P_pad]`` (P_pad the next
    multiple of 32, and a wider one) against the torch reference on contiguous rows, two steps;
    the pad columns keep their sentinel."""
    gen = torch.Generator().manual_seed(P)
    w0, v0 = torch.randn(m, P, generator=gen), torch.randn(m, P, generator=gen)
    g = torch.randn(m, P, generator=gen).to(dtype)
    z = w0.mean(0)
    for P_pad in (-(-P // 32) * 32 + (32 if P % 32 == 0 else 0), P + 100):
        w, v, gp = padded(w0, P_pad), padded(v0, P_pad), padded(g, P_pad)
        assert w.stride(0) == P_pad and not w.is_contiguous()
        w_ref, v_ref = w0.clone(), v0.clone()
        for step in range(2):
            kw = dict(lr=0.05, momentum=0.9, nesterov=step == 1, weight_decay=1e-3, alpha=0.3,
                      first_step=step == 0)
            acc = K.TritonSMAKernels(block=block).local_update(w, v, gp, z, **kw)
            acc_ref = sma_local_update(w_ref, v_ref, g.float(), z, **kw)
            torch.testing.assert_close((w, v, acc), (w_ref, v_ref, acc_ref), atol=ATOL * m,
                                       rtol=RTOL)
        for t in (w, v, gp):
            assert (pad_columns(t) == SENTINEL).all()


def test_kernel_rejects_rows_it_cannot_index():
    w, v, g = torch.randn(3, 40), torch.randn(3, 40), torch.randn(3, 40)
    z = w.mean(0)
    kw = dict(lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0, alpha=0.5)
    backend = K.TritonSMAKernels(block=16)
    with pytest.raises(ValueError, match=r"w \[3, 40\] has stride \(1, 3\): .*unit-stride rows"):
        backend.local_update(w.t().contiguous().t(), v, g, z, **kw)
    with pytest.raises(ValueError, match=r"rows of w, v, g \[3, 40\] are \{'w': 64, 'v': 40, "
                                         r"'g': 40\} elements apart"):
        backend.local_update(padded(w, 64), v, g, z, **kw)
    with pytest.raises(ValueError, match="rows of w, v, g"):  # overlapping rows
        backend.local_update(w[:1].expand(3, 40), v, g, z, **kw)
    with pytest.raises(ValueError, match="row_stride=30 < P=40"):
        K.local_spec(3, 40, torch.float32, "cuda", momentum=0.0, nesterov=False,
                     weight_decay=0.0, first_step=False, correct=False, row_stride=30)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 13)  # P = 8·13 + 13 + 13·3 + 3 = 159: ≡ 31 mod 32
        self.fc2 = nn.Linear(13, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _fit(pad: bool, monkeypatch, *, backend: str, dtype=torch.float32, resize_to: int = 0):
    monkeypatch.setattr(state_module, "_PAD_ROWS_ON_CPU", pad)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=gen).to(dtype),
                         torch.randint(0, 3, (48,), generator=gen))
    plan = make_plan(MLP, dtype=dtype, input_shape=(8,), replicas=3, devices=1, kernel_backend=backend,
                     executor="inline", sync=cg.SMA(sync_every=2),
                     optimizer=cg.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3))
    rows = _rows(plan, pad)
    plan.fit(data, 1, seed=3, progress=False)
    if resize_to:
        plan.set_replicas(resize_to)  # DeviceState.resize: new buffers
        rows = _rows(plan, pad)
        plan.fit(data, 1, seed=4, progress=False)
    return plan, rows


def _rows(plan, pad: bool) -> list[torch.Tensor]:
    """The state's row buffers (w, v, g, and w_model when low precision), pads set to the sentinel."""
    s = plan.states[0]
    rows = [s.w, s.v, s.g] + ([s.w_model] if s.w_model is not s.w else [])
    for t in rows if pad else ():
        pad_columns(t).fill_(SENTINEL)
    return rows


@pytest.mark.parametrize("backend,dtype,resize_to",
                         [("torch", torch.float32, 0), ("torch", torch.bfloat16, 0),
                          ("triton", torch.float32, 0), ("torch", torch.float32, 5)])
def test_fit_on_padded_state_is_the_unpadded_fit(monkeypatch, backend, dtype, resize_to):
    """(b) A DeviceState with its rows padded (forced on the CPU) trains the same weights as the
    contiguous one, bit for bit: the same kernels on the same values in the same order. The
    pads keep their sentinel, so nothing reads or writes them (and a resize pads too)."""
    flat, _ = _fit(False, monkeypatch, backend=backend, dtype=dtype, resize_to=resize_to)
    plan, rows = _fit(True, monkeypatch, backend=backend, dtype=dtype, resize_to=resize_to)
    P = plan.num_parameters
    assert P % 32 and all(t.stride(0) == 160 and t.shape[1] == P for t in rows)
    assert (flat.replica_weights() - flat.replica_weights().mean()).abs().max() > 0
    torch.testing.assert_close(plan.replica_weights(), flat.replica_weights(), atol=0, rtol=0)
    torch.testing.assert_close(plan.central_weights(), flat.central_weights(), atol=0, rtol=0)
    for t in rows:
        assert (pad_columns(t) == SENTINEL).all()
    if backend == "triton":  # plan.kernels lists the padded specs, the ones that ran
        local = [k for k in plan.kernels if k.spec.kind == "sma_local"]
        assert all(k.spec.row_stride == 160 for k in local) and sum(k.launches for k in local)


def test_row_length_pads_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert state_module.row_length(61_706, cpu) == 61_706  # shared memory, C kernels: plain rows
    assert state_module.row_length(61_706, cuda) == 61_728
    assert state_module.row_length(65_536, cuda) == 65_536
    assert state_module.row_length(1, cuda) == 32
