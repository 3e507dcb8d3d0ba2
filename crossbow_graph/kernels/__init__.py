"""The SMA update kernels (docs/design-overview.md §4; docs/kernels.md): the torch reference
(torch_ref), the C kernels for the CPU (c_sma, sma_cpu.c), the Triton kernels (triton_sma), and
the choice between them (select)."""

__all__: list[str] = []
