"""The learners: forward and backward in both learner modes, gradient clipping, the local update
of a device's rows, numerical faults and a fit's intra-op threads (docs/design-overview.md §2, §5)."""

__all__: list[str] = []
