"""The compiler: trace (torch.fx + shapes), analysis (FLOPs, bytes, memory), passes with the
verifier between them, and inspection of the resulting task graph (docs/design-overview.md §1, §3;
docs/compiler.md)."""

__all__: list[str] = []
