"""The round engine (docs/design-overview.md §5): per-device flat state, learners of both
modes, the inline executor with CUDA streams, the process executor, numerical faults and the
torch.distributed global sync."""

__all__: list[str] = []
