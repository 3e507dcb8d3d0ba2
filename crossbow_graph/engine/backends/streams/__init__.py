"""Rounds on CUDA streams: the streams and events of the discipline and the backend over them
(docs/runtime.md, Streams on CUDA)."""

__all__: list[str] = []
