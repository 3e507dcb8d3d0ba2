"""The tables of docs/options.md, printed from the option dataclasses (``CompileOptions``,
``FitOptions``): name, type or choices, default, doc of every field.

    python scripts/option_tables.py           # print the tables
    python scripts/option_tables.py --write   # put them into docs/options.md, between the markers

tests/test_options.py fails when docs/options.md holds other tables than these.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
from typing import Any, Literal, Union, get_args, get_origin

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbow_graph import CompileOptions, FitOptions  # noqa: E402

__all__ = ["tables", "replace_tables", "main", "DOC", "BEGIN", "END"]

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "options.md")
BEGIN = "<!-- option tables: scripts/option_tables.py --write -->"
END = "<!-- end of option tables -->"
TABLES = (("compile", CompileOptions), ("Plan.fit", FitOptions))


def type_text(t: Any) -> str:
    """A field's type as the table shows it: a Literal as its choices, ``a | b`` for a union."""
    if isinstance(t, str):  # a forward reference, as written
        return t
    origin, args = get_origin(t), get_args(t)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if t is type(None):
        return "None"
    if t is Any:
        return "Any"
    if t is Ellipsis:
        return "..."
    if isinstance(t, list):  # Callable's arguments
        return "[" + ", ".join(type_text(a) for a in t) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]"
    return getattr(t, "__qualname__", str(t))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(call: str, cls: type) -> str:
    """The markdown table of ``cls``'s fields, the options of ``call``."""
    lines = [f"### `{call}` options (`{cls.__name__}`)", "",
             "| option | type | default | what it sets |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = "required" if f.default is dataclasses.MISSING else f"`{_cell(repr(f.default))}`"
        lines.append(f"| `{f.name}` | `{_cell(type_text(f.type))}` | {default} | "
                     f"{_cell(f.metadata['doc'])} |")
    return "\n".join(lines)


def tables() -> str:
    """Every options table, as docs/options.md holds them between BEGIN and END."""
    return "\n\n".join(table(call, cls) for call, cls in TABLES)


def replace_tables(text: str, new: str) -> str:
    """``text`` (docs/options.md) with what lies between BEGIN and END replaced by ``new``.

    Raises:
        ValueError: ``text`` lacks a marker.
    """
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"docs/options.md lacks the markers {BEGIN!r} … {END!r}")
    return f"{head}{BEGIN}\n\n{new}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the tables of {DOC}")
    args = parser.parse_args(argv)
    if not args.write:
        print(tables())
        return 0
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(replace_tables(text, tables()))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
