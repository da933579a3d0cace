"""Command-line friction (issue 23 item 5): field and flag names interchangeable, choices and defaults in
``--help``, flag-named metavars, a short usage on an argument error, progress bars while generating, the
traversal's values and the row's name in ``generate``'s output, and ``data synth --list`` without torch."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from disentanglement import cli
from disentanglement.config import (
    FIELDS,
    ConfigError,
    build_config,
    field_flag,
    flag_metavar,
    read_config_file,
)
from disentanglement.generation import SamplingOptions, format_generations, generate
from disentanglement.options import SUBCOMMAND_OPTIONS

SRC = Path(__file__).resolve().parents[1] / "src"
GREEDY = SamplingOptions(greedy=True, max_new_tokens=6)


def subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


# --------------------------------------------------------------------------- names


def test_a_flag_name_works_as_a_config_key_and_the_other_way_round(tmp_path):
    config = build_config(
        {"token-weighted-reconstruction-weight": 0.5, "token_weighted_reconstruction_alpha": 2.0, "max-steps": 7}
    )
    assert config.reconstruction.token_weighted_weight == 0.5
    assert config.reconstruction.token_weight_alpha == 2.0 and config.train.max_steps == 7
    with pytest.raises(ConfigError, match="'token_weighted_weight' is given twice"):
        build_config({"token_weighted_weight": 1, "token-weighted-reconstruction-weight": 2})
    with pytest.raises(ConfigError, match="unknown config field 'betta' \\(did you mean 'beta'"):
        build_config({"betta": 1})
    path = tmp_path / "c.yaml"
    path.write_text("token-weighted-reconstruction-weight: 1.5\nkl:\n  beta-schedule: constant\n")
    assert read_config_file(path) == {"token_weighted_weight": 1.5, "beta_schedule": "constant"}
    path.write_text("token_weighted_weight: 1\ntoken-weighted-reconstruction-weight: 2\n")
    with pytest.raises(ConfigError, match="given twice"):
        read_config_file(path)
    # on the command line: every field's name (with - or _) and the flag's underscore form
    parser = cli.build_parser()
    argv = ["train", "--token-weighted-weight", "2", "--token_weight_alpha=3", "--no-kl_per_token", "--max_steps", "5"]
    args = parser.parse_args(argv)
    assert (args.token_weighted_weight, args.token_weight_alpha, args.kl_per_token, args.max_steps) == (2, 3, False, 5)
    args = parser.parse_args(["generate", "R", "--prompt", "p", "--traverse-range=-1:1", "--attributes", "a:1"])
    assert args.traverse_range == "-1:1" and args.attributes == ["a:1"]
    assert cli._attach_negative_values(["--traverse-range", "-2:2"]) == ["--traverse-range=-2:2"]


def test_every_config_field_and_flag_spelling_resolves_to_its_field():
    from disentanglement.config import canonical_field

    for name, (_, f) in FIELDS.items():
        flag = field_flag(f)
        for spelled in (name, name.replace("_", "-"), flag, flag[2:], flag[2:].replace("-", "_")):
            assert canonical_field(spelled) == name, spelled


# --------------------------------------------------------------------------- --help


def test_help_lists_choices_defaults_once_and_flag_metavars():
    train = subparser("train")
    text = train.format_help()
    for flag, choices in (
        ("--latent", "{discrete,continuous}"),
        ("--encoder-view", "{mean_last,token_weighted,attention,token_weighted_attention}"),
        ("--beta-schedule", "{constant,linear,cyclical}"),
        ("--decoder-training", "{frozen,lora,full}"),
    ):
        assert f"{flag} {choices}" in text
    decoder = next(a for a in train._actions if "--decoder-training" in a.option_strings)
    assert "'full' = every decoder weight" in decoder.help and "or all" not in decoder.help
    for name in ("train", *SUBCOMMAND_OPTIONS):
        parser = subparser(name)
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert len(re.findall(r"\bdefault[: ]", shown.lower())) <= 1, (name, action.option_strings, shown)
            if action.metavar is not None and action.choices is None:
                explicit = {"--attribute", "--traverse", "--range", "--code-examples", "--explore-prompt"}
                if action.option_strings[0] not in explicit:
                    assert action.metavar == flag_metavar(action.option_strings[0]), action.option_strings
    assert "TOKEN_WEIGHTED_RECONSTRUCTION_WEIGHT" in text and "TOKEN_WEIGHTED_WEIGHT " not in text
    assert "--token-weighted-weight" in text  # the field's name is listed as the flag's other spelling
    assert "(default: None)" not in subparser("eval").format_help()


def test_an_argument_error_prints_a_short_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--latent", "foo"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "usage: disentangle train [options]",
        "disentangle train: error: argument --latent: invalid choice: 'foo' (choose from 'discrete', 'continuous')",
        "(`disentangle train --help` lists every option)",
    ]
    with pytest.raises(SystemExit):
        cli.main(["generate", "RUN"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "usage: disentangle generate [options] CHECKPOINT --prompt PROMPT" and len(err) == 3


# --------------------------------------------------------------------------- data synth --list


def test_data_synth_list_imports_neither_torch_nor_transformers():
    code = (
        "import sys; from disentanglement.cli import main; rc = main(['data', 'synth', '--list']); "
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'sklearn') if m in sys.modules]; "
        "print('HEAVY', heavy, rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}, check=True
    ).stdout
    assert "two-factor" in out and out.strip().splitlines()[-1] == "HEAVY [] 0"


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def continuous(continuous_run):
    model, tok, config, _ = continuous_run.load()
    return model, tok, config


@pytest.fixture(scope="module")
def discrete(discrete_run):
    model, tok, config, _ = discrete_run.load()
    return model, tok, config


def test_traverse_prints_each_dimensions_value(continuous):
    model, tok, config = continuous
    result = generate(model, tok, config, ["sun pen 201"], traverse=1, traverse_range="-1:1", steps=3, sampling=GREEDY)
    table = format_generations(result)
    assert "traversal of dimension 1: offsets -1, +0, +1" in table
    for g in result["generations"]:
        d = g["latent_description"]
        assert d["value"] == pytest.approx(d["z"][1], abs=1e-4)
        assert f"dim1{d['offset']:+.2f} (z[1]={d['value']:+.3f})" in g["latent"]
        assert f"{g['latent']} | " in table


def test_row_output_names_the_row(discrete, continuous):
    model, tok, config = discrete
    rows = [{"codes": [0]}, {"codes": [2]}, {"codes": [1]}]
    result = generate(model, tok, config, ["sun pen 201"], latents=rows, row=1, sampling=GREEDY)
    assert [g["latent"] for g in result["generations"]] == ["row 1 codes=2"]
    assert format_generations(result).startswith("latent of row 1 of ")
    model, tok, config = continuous
    rows = [{"mu": [0.1, 0.2, 0.3, 0.4]}, {"mu": [0.0, -1.0, 0.5, 0.0]}]
    result = generate(model, tok, config, ["sun pen 201"], latents=rows, row=1, sampling=GREEDY)
    assert [g["latent"] for g in result["generations"]] == ["row 1"]
    assert "latent of row 1 of " in format_generations(result)


def test_generate_shows_progress(discrete_run, injected_loader, capsys):
    argv = ["generate", str(discrete_run.run_dir), "--prompt", "sun pen 201", "--greedy", "--max-new-tokens", "4"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "generate: 100%" in err and "4/4" in err  # one response per code of the slot
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "generate:" not in capsys.readouterr().err


def test_eval_generation_and_the_explorer_show_progress(discrete_run, injected_loader, tmp_path, capsys):
    common = ["--max-examples", "8", "--batch-size", "8"]
    argv = ["eval", str(discrete_run.run_dir), "--output", str(tmp_path / "e.json"), "--iw-samples", "1", *common]
    assert cli.main([*argv, "--generation", "--generation-prompts", "2", "--generation-max-new-tokens", "3"]) == 0
    assert "generate: 100%" in capsys.readouterr().err
    argv = ["inspect", str(discrete_run.run_dir), "--explore", "--output", str(tmp_path / "x.html"), *common]
    assert cli.main([*argv, "--explore-prompts", "1", "--explore-tokens", "3", "--explore-examples", "1"]) == 0
    assert "generate: 100%" in capsys.readouterr().err


def test_options_dataclasses_still_match_their_flags():
    # a field's other spellings are not actions of their own: each dest has one action
    for name in SUBCOMMAND_OPTIONS:
        dests = [a.dest for a in subparser(name)._actions if a.option_strings]
        assert len(dests) == len(set(dests)), name
        assert {f.name for f in dataclasses.fields(SUBCOMMAND_OPTIONS[name])} <= set(dests)
