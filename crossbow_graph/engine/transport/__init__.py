"""Across processes: torchrun's collectives, torchft's replica groups and the transports the sync
algorithms sum and broadcast through (docs/design-overview.md §5; docs/distributed.md)."""

__all__: list[str] = []
