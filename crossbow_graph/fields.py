"""Options as typed fields (docs/options.md): each option of ``compile`` and ``Plan.fit`` is one
dataclass field with its default, a one-line doc (``metadata["doc"]``) and, for a choice, a
``Literal`` type. ``CompileOptions`` (compile_options.py) and ``FitOptions``
(training/options.py) are made of them; their checks, the docs' tables
(scripts/option_tables.py) and the CLI's defaults and choices (cli_options.py) come from them."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeVar, get_args, get_origin

__all__ = ["option", "check_choices", "options_of"]

OptionsT = TypeVar("OptionsT")


def option(default: Any = dataclasses.MISSING, *, doc: str) -> Any:
    """A field of an options dataclass: ``default`` (left out: the option is required) and
    ``doc``, one line on what the option sets."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def check_choices(options: Any) -> None:
    """Check every field of ``options`` (an options dataclass) whose type is a ``Literal``: its
    value must be one of the Literal's strings. The options' module keeps its annotations as
    objects (no ``from __future__ import annotations``), so ``field.type`` is the Literal.

    Raises:
        ValueError: a value not among the choices, e.g. "executor='thread': use one of 'auto',
            'inline', 'process'"."""
    for field in dataclasses.fields(options):
        if get_origin(field.type) is not Literal:
            continue
        choices, value = get_args(field.type), getattr(options, field.name)
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{field.name}={value!r}: use one of {', '.join(map(repr, choices))}")


def options_of(cls: type[OptionsT], keywords: dict[str, Any], options: OptionsT | None,
               call: str) -> OptionsT:
    """The options of a ``call`` that takes them as keywords or as one ``options=cls(...)``:
    ``cls(**keywords)`` (checked by ``cls``) when ``options`` is None, else ``options``, all
    of whose keywords must then be at their defaults (a required option's keyword at None).

    Raises:
        TypeError: ``options`` is not a ``cls``.
        ValueError: ``options`` and a keyword away from its default, both given; or what ``cls``
            raises for a bad keyword."""
    if options is None:
        return cls(**keywords)
    if not isinstance(options, cls):
        raise TypeError(f"{call}(options={options!r:.60}): must be crossbow_graph.{cls.__name__}"
                        "(...), or None (the keywords)")
    defaults = {f.name: None if f.default is dataclasses.MISSING else f.default
                for f in dataclasses.fields(cls)}
    given = [name for name, value in keywords.items() if not _is_default(value, defaults[name])]
    if given:
        raise ValueError(f"{call}() got options={cls.__name__}(...) and {', '.join(given)}: give "
                         "each option once, in options or as a keyword; to change one, pass "
                         f"options=dataclasses.replace(options, {given[0]}=...)")
    return options


def _is_default(value: Any, default: Any) -> bool:
    """``value`` is ``default``, or equal to it and of its type (True is not the default 1)."""
    return value is default or (type(value) is type(default) and value == default)
