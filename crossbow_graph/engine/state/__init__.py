"""The replicas' state: flat per-device buffers, precision, the local optimiser and a round's
hyper-parameter snapshot (docs/design-overview.md §1, §5)."""

__all__: list[str] = []
