"""Rounds captured in CUDA graphs: capture and replay, the graph's inputs and what a capture cannot
take (docs/runtime.md, CUDA-graph rounds)."""

__all__: list[str] = []
