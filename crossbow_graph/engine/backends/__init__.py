"""The backends that run rounds: inline, on CUDA streams, in CUDA graphs and in worker processes
(docs/design-overview.md §5; docs/runtime.md, Backends)."""

__all__: list[str] = []
