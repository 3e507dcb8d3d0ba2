"""Run-time tuning (docs/design-overview.md §5): the adjustment interface, metrics (the
gradient noise scale), the auto-tuner and the hyper-parameter policies."""

__all__: list[str] = []
