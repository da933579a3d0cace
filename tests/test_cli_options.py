"""The eval, generate, inspect and encode flags are built from their options dataclasses (``options.py``)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from disentanglement import cli, commands
from disentanglement.config import field_flag
from disentanglement.options import (
    SUBCOMMAND_OPTIONS,
    EncodeOptions,
    EvalOptions,
    GenerateOptions,
    InspectOptions,
    options_from,
)

#: What each subcommand needs besides its positional checkpoint (its required flags).
REQUIRED_ARGS = {
    "eval": [],
    "generate": ["--prompt", "hi"],
    "inspect": [],
    "encode": ["--output", "z.jsonl"],
    "refit-encoder": ["--output-dir", "refit"],
}


def subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("name", sorted(SUBCOMMAND_OPTIONS))
def test_every_field_has_its_flag_and_its_default(name):
    cls = SUBCOMMAND_OPTIONS[name]
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    actions = {a.dest: a for a in subparser(name)._actions}
    for f in dataclasses.fields(cls):
        assert f.name in actions, f"{cls.__name__}.{f.name} has no flag"
        assert field_flag(f) in actions[f.name].option_strings, (f.name, actions[f.name].option_strings)
        assert actions[f.name].help == f.metadata["help"]
    args = cli.build_parser().parse_args([name, "RUN", *REQUIRED_ARGS[name]])
    parsed = options_from(cls, args)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert actions[f.name].required, f"{cls.__name__}.{f.name} has no default, so its flag is required"
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert getattr(parsed, f.name) == default, f.name
    assert args.checkpoint == "RUN" and args.command == name


@pytest.mark.parametrize("name", sorted(SUBCOMMAND_OPTIONS))
def test_no_flag_without_a_field(name):
    """Every flag of the subcommand (but --help and the positional checkpoint) is a field of its options."""
    fields = {f.name for f in dataclasses.fields(SUBCOMMAND_OPTIONS[name])}
    dests = {a.dest for a in subparser(name)._actions if a.option_strings and a.dest != "help"}
    assert dests == fields


def test_the_defaults_are_the_run_functions_defaults():
    """``run_eval`` and ``run_inspect`` start from the same dataclass: one default each."""
    assert EvalOptions().iw_samples == 8 and EvalOptions().prior_samples == 16 and EvalOptions().exact_limit == 64
    assert InspectOptions().exact_limit == EvalOptions().exact_limit == EncodeOptions(output="z").exact_limit
    assert InspectOptions().batch_size == EvalOptions().batch_size == GenerateOptions(prompt=["x"]).batch_size
    with pytest.raises(TypeError):  # the encode output and the generate prompts have no default
        EncodeOptions()
    with pytest.raises(TypeError):
        GenerateOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        EvalOptions().seed = 3  # type: ignore[misc]


def test_flags_parse_into_the_options():
    args = cli.build_parser().parse_args(
        ["eval", "RUN", "--iw-samples", "4", "--exact-limit", "0", "--no-progress", "--generation", "--device", "cpu"]
    )
    options = options_from(EvalOptions, args)
    assert options == EvalOptions(iw_samples=4, exact_limit=0, progress=False, generation=True, device="cpu")
    argv = ["generate", "RUN", "--prompt", "a", "--prompt", "b", "--attribute", "x:1", "--range=-2:2", "--greedy"]
    generate = options_from(GenerateOptions, cli.build_parser().parse_args([*argv, "--mode", "traverse"]))
    assert generate.prompt == ["a", "b"] and generate.attributes == ["x:1"] and generate.traverse_range == "-2:2"
    kwargs = generate.generate_kwargs()
    assert kwargs["mode"] == "traverse" and kwargs["sampling"].greedy and kwargs["sampling"].seed == 0
    assert "prompt" not in kwargs and "batch_size" not in kwargs
    inspect = options_from(InspectOptions, cli.build_parser().parse_args(["inspect", "RUN", "--explore-prompt", "p"]))
    assert inspect.explore_prompt_texts == ["p"] and inspect.plots and not inspect.explore
    with pytest.raises(SystemExit):  # choices come from the Literal
        cli.build_parser().parse_args(["generate", "RUN", "--prompt", "a", "--mode", "nope"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["eval", "RUN", "--device", "tpu"])


def test_run_functions_take_options_and_keyword_overrides(monkeypatch):
    """``run_eval(ckpt, options, **overrides)``: the overrides replace fields, and an unknown one is refused."""

    def stop(checkpoint, data):
        raise RuntimeError("stop")

    monkeypatch.setattr(commands, "check_data_option", stop)
    with pytest.raises(ValueError, match="--iw-samples must be an integer >= 1, got 0"):
        commands.run_eval("RUN", EvalOptions(iw_samples=3), iw_samples=0)
    with pytest.raises(TypeError):
        commands.run_eval("RUN", not_an_option=1)
    with pytest.raises(ValueError, match="--index must be an integer >= 0, got -1"):
        commands.run_inspect("RUN", InspectOptions(), index=-1)
    with pytest.raises(RuntimeError, match="stop"):
        commands.run_inspect("RUN", InspectOptions(index=2))


@pytest.mark.parametrize(
    "argv",
    [[], ["train"], ["eval"], ["generate"], ["inspect"], ["encode"], ["sweep"], ["data"], ["data", "synth"]],
    ids=lambda argv: " ".join(argv) or "disentangle",
)
def test_every_help_page_renders(argv, capsys):
    # argparse %-formats help strings: a bare "%" in one (e.g. "95% intervals") crashed `disentangle --help`
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert "usage: disentangle" in capsys.readouterr().out
