"""Each option of ``compile`` and ``Plan.fit`` is stated once: a field of ``CompileOptions`` or
``FitOptions`` (default, doc, Literal choices). The functions' keywords and defaults, the checks
of the choices, the docs' tables and the CLI's flags are held to those fields here."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import Literal, get_args, get_origin

import pytest
import torch
from torch import nn

import crossbow_graph as cg
from crossbow_graph import cli_options
from crossbow_graph.cli import build_parser

from _plans import TinyNet, make_plan, tiny_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_OPTIONS = {"compile": {"model", "example_inputs", "loss_fn", "options"},
               "fit": {"self", "train_dataset", "eval_dataset", "options"}}
CASES = [("compile", cg.compile, cg.CompileOptions), ("fit", cg.Plan.fit, cg.FitOptions)]


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and a == b)


@pytest.mark.parametrize("name, function, cls", CASES, ids=[c[0] for c in CASES])
def test_every_field_is_a_keyword_with_the_fields_default(name, function, cls):
    """Every keyword but the data is a field, with the field's default (a required field's
    keyword defaults to None: ``options=`` gives it), and every field has a doc."""
    params = inspect.signature(function).parameters
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(params) - NOT_OPTIONS[name] == set(fields)
    for field in fields.values():
        default = None if field.default is dataclasses.MISSING else field.default
        assert _same(params[field.name].default, default), (field.name, params[field.name].default)
        assert params[field.name].kind in (inspect.Parameter.KEYWORD_ONLY,
                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)
        assert field.metadata["doc"].strip() and "\n" not in field.metadata["doc"], field.name


@pytest.mark.parametrize("cls, needed, expected", [
    (cg.CompileOptions, dict(batch_size=4),
     {"learner_mode", "executor", "kernel_backend", "precision", "memory_format", "cpu_conv"}),
    (cg.FitOptions, {}, {"lr_scheduler_interval"}),
], ids=["compile", "fit"])
def test_a_value_outside_a_literal_fields_choices_is_refused_when_built(cls, needed, expected):
    literal = {f.name for f in dataclasses.fields(cls) if get_origin(f.type) is Literal}
    assert literal == expected  # the fields' types are Literal objects, not strings
    for name in sorted(literal):
        choices = ", ".join(map(repr, get_args({f.name: f for f in dataclasses.fields(cls)}[name].type)))
        with pytest.raises(ValueError, match=rf"^{name}='bogus': use one of {choices}$"):
            cls(**needed, **{name: "bogus"})


def test_options_objects_train_as_the_same_keywords_do():
    """compile(options=CompileOptions(...)) and fit(options=FitOptions(...)) give the plan and
    the z that the same keywords give, bit for bit."""
    example, loss = (torch.zeros(2, 1, 8, 8),), nn.functional.cross_entropy
    settings = dict(batch_size=4, replicas=2, executor="inline", sync=cg.SMA(sync_every=2))
    torch.manual_seed(0)
    by_keywords = cg.compile(TinyNet(), example, loss, **settings)
    by_keywords.fit(tiny_data(48), 2, seed=3, shuffle=True, progress=False, metrics_every=None)
    options = cg.CompileOptions(**settings)
    torch.manual_seed(0)
    by_options = cg.compile(TinyNet(), example, loss, options=options)
    assert by_options.options is options and by_options.num_learners == 2
    by_options.fit(tiny_data(48), options=cg.FitOptions(epochs=2, seed=3, shuffle=True,
                                                         progress=False, metrics_every=None))
    assert torch.equal(by_options.central_weights(), by_keywords.central_weights())
    assert by_options.rounds_done == by_keywords.rounds_done == 12


def test_options_and_keywords_together_are_refused():
    with pytest.raises(ValueError, match=r"fit\(\) got options=FitOptions\(\.\.\.\) and seed, "
                                         r"progress: give each option once.*"
                                         r"dataclasses.replace\(options, seed=\.\.\.\)"):
        make_plan().fit(tiny_data(16), seed=1, progress=False, options=cg.FitOptions())
    with pytest.raises(ValueError, match=r"compile\(\) got options=CompileOptions\(\.\.\.\) and "
                                         r"batch_size"):
        make_plan(batch_size=4, options=cg.CompileOptions(batch_size=8))
    with pytest.raises(TypeError, match=r"fit\(options=\{'epochs': 2\}\): must be "
                                        r"crossbow_graph.FitOptions\(\.\.\.\)"):
        make_plan().fit(tiny_data(16), options={"epochs": 2})
    with pytest.raises(ValueError, match=r"batch_size=None: must be a positive integer"):
        cg.compile(TinyNet(), (torch.zeros(1, 1, 8, 8),), nn.functional.cross_entropy)  # no b


def test_the_docs_tables_are_the_scripts():
    """docs/options.md holds the tables scripts/option_tables.py prints from the dataclasses
    (``python scripts/option_tables.py --write`` renews them)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import option_tables
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", "options.md"), encoding="utf-8") as f:
        text = f.read()
    assert text == option_tables.replace_tables(text, option_tables.tables())
    for cls in (cg.CompileOptions, cg.FitOptions):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text


def test_cli_flags_take_the_options_defaults_and_choices_but_the_listed_exceptions():
    """A train flag that sets an option has the option's default and choices, unless
    CLI_DEFAULTS lists it, with a reason and a default that does differ; every train flag named
    after an option of compile or fit is mapped to it, or builds the option's value
    (BUILDING_FLAGS)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    actions = {a.option_strings[0]: a for a in sub.choices["train"]._actions if a.option_strings}
    for flag, (cls, name) in cli_options.OPTION_FLAGS.items():
        field = {f.name: f for f in dataclasses.fields(cls)}[name]
        option_default = None if field.default is dataclasses.MISSING else field.default
        action = actions[flag]
        if flag in cli_options.CLI_DEFAULTS:
            cli_default, reason = cli_options.CLI_DEFAULTS[flag]
            assert _same(action.default, cli_default) and reason, flag
            assert not _same(cli_default, option_default), f"{flag}: no exception, drop it"
        else:
            assert _same(action.default, option_default), (flag, action.default, option_default)
        kind = cli_options.option_field_type(cls, name)
        choices = get_args(kind) if get_origin(kind) is Literal else None
        assert (tuple(action.choices) if action.choices else None) == choices, flag
    assert set(cli_options.CLI_DEFAULTS) <= set(cli_options.OPTION_FLAGS)
    names = {f.name for cls in (cg.CompileOptions, cg.FitOptions) for f in dataclasses.fields(cls)}
    unmapped = [flag for flag, a in actions.items() if a.dest in names
                and flag not in {**cli_options.OPTION_FLAGS, **cli_options.BUILDING_FLAGS}]
    assert not unmapped
