"""Rounds in worker processes on the CPU: the executor, the learner groups, their shared-memory
messages and the workers' convolution library (docs/runtime.md, Worker processes)."""

__all__: list[str] = []
