"""Test scaffolding outside the product: the CPU simulators of CUDA streams (a race checker) and
CUDA graphs (a capture checker). The package's product modules never import it; the tests and
bench/ use it (docs/contributing.md)."""

__all__: list[str] = []
