"""A round as a program: the task graph's order, the interpreter, a round's environment and
result, the backends' protocol and the timeline (docs/design-overview.md §3, §5)."""

__all__: list[str] = []
