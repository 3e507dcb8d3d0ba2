"""A round's data inside the engine: batches split by learner and device, a sample's inputs, the
batch copied ahead and the rows shipped to worker processes (docs/design-overview.md §1, §6)."""

__all__: list[str] = []
