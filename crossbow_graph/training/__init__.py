"""The fit loop (docs/design-overview.md §2, §6): data order, hooks, history, checkpoints,
logs and the start-of-fit checks."""

__all__: list[str] = []
