"""Configuration (docs/design.md section 6): flags for every field, seed flags, validation, files, overrides."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import typing
from pathlib import Path

import pytest
import yaml

from disentanglement import config as cfg
from disentanglement.config import (
    SECTIONS,
    ConfigError,
    ReconstructionLossConfig,
    RunConfig,
    add_config_arguments,
    build_config,
    config_from_namespace,
    load_run_config,
    read_config_file,
    write_run_config,
)

SEED_FLAGS = {
    "--token-weighted-reconstruction-weight": "token_weighted_weight",
    "--token-weighted-reconstruction-alpha": "token_weight_alpha",
    "--normalized-concentration-corrected-token-weighted-reconstruction-weight": (
        "normalized_concentration_corrected_token_weighted_weight"
    ),
    "--zfree-reference-scale": "zfree_reference_scale",
}
WEIGHT_FIELDS = (
    "reconstruction_weight",
    "sequence_reconstruction_weight",
    "token_weighted_weight",
    "normalized_concentration_corrected_token_weighted_weight",
    "normalized_inverse_surprisal_token_weighted_weight",
    "zfree_relative_weight",
)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disentangle-test")
    parser.add_argument("--config", default=None)
    add_config_arguments(parser)
    return parser


def all_fields():
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, cls, f


def expected_flag(f: dataclasses.Field) -> str:
    for flag, name in SEED_FLAGS.items():
        if name == f.name:
            return flag
    return "--" + f.name.replace("_", "-")


# ----------------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------------


def test_sections_cover_the_design():
    assert [cls.__name__ for cls in SECTIONS.values()] == [
        "ReconstructionLossConfig",
        "LatentConfig",
        "KLConfig",
        "DivergenceConfig",
        "ModelConfig",
        "DataConfig",
        "TrainConfig",
    ]


def test_every_field_has_its_flag():
    parser = make_parser()
    by_dest: dict[str, list[str]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).extend(action.option_strings)
    help_text = parser.format_help()
    seen = 0
    for section, _cls, f in all_fields():
        flag = expected_flag(f)
        assert f.name in by_dest, f"{section}.{f.name} has no flag"
        assert flag in by_dest[f.name], f"{section}.{f.name}: expected {flag}, got {by_dest[f.name]}"
        assert re.search(re.escape(flag) + r"\b", help_text), flag
        seen += 1
    assert seen == sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
    # no two fields share a flag
    flags = [s for a in parser._actions for s in a.option_strings]
    assert len(flags) == len(set(flags))


def test_every_flag_round_trips_its_default():
    """Each field's flag, given its default value, parses and builds the default config."""
    parser = make_parser()
    argv: list[str] = []
    for _section, _cls, f in all_fields():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = expected_flag(f)
        if isinstance(default, bool):
            argv.append(flag if default else "--no-" + flag[2:])
        elif isinstance(default, list):
            argv += [flag, *default]
        elif default is None:
            argv += [flag, "none"]
        else:
            argv += [flag, str(default)]
    args = parser.parse_args(argv)
    for _section, _cls, f in all_fields():
        assert hasattr(args, f.name), f.name
    assert config_from_namespace(args) == RunConfig()


def test_flags_default_to_not_given():
    args = make_parser().parse_args([])
    assert set(vars(args)) == {"config"}
    assert config_from_namespace(args) == RunConfig()


@pytest.mark.parametrize(("flag", "field_name"), list(SEED_FLAGS.items()))
def test_seed_flags_map_to_their_fields(flag, field_name):
    args = make_parser().parse_args([flag, "0.75"])
    assert getattr(args, field_name) == 0.75
    run = config_from_namespace(args)
    assert getattr(run.reconstruction, field_name) == 0.75
    assert field_name in {f.name for f in dataclasses.fields(ReconstructionLossConfig)}
    # the field-derived spelling is not also a flag for the seed-fixed fields
    derived = "--" + field_name.replace("_", "-")
    if derived != flag:
        with pytest.raises(SystemExit):
            make_parser().parse_args([derived, "0.75"])


def test_all_seed_flags_together():
    args = make_parser().parse_args(
        [
            "--token-weighted-reconstruction-weight",
            "0.5",
            "--token-weighted-reconstruction-alpha",
            "2",
            "--normalized-concentration-corrected-token-weighted-reconstruction-weight",
            "1.5",
            "--zfree-reference-scale",
            "3.25",
        ]
    )
    rec = config_from_namespace(args).reconstruction
    assert rec.token_weighted_weight == 0.5
    assert rec.token_weight_alpha == 2.0
    assert rec.normalized_concentration_corrected_token_weighted_weight == 1.5
    assert rec.zfree_reference_scale == 3.25
    assert rec.normalized_inverse_surprisal_token_weighted_weight == 0.0


def test_sections_argument_limits_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, sections=["reconstruction"])
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(ReconstructionLossConfig)} <= dests
    assert "batch_size" not in dests


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def assert_config_error(match_field: str, value, **kwargs):
    with pytest.raises(ConfigError) as info:
        ReconstructionLossConfig(**kwargs)
    message = str(info.value)
    assert f"ReconstructionLossConfig.{match_field}" in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize("name", WEIGHT_FIELDS)
@pytest.mark.parametrize("value", [-1.0, -1e-9])
def test_negative_weight_rejected(name, value):
    assert_config_error(name, value, **{name: value})


@pytest.mark.parametrize("name", WEIGHT_FIELDS)
def test_zero_weight_accepted(name):
    assert getattr(ReconstructionLossConfig(**{name: 0.0}), name) == 0.0


@pytest.mark.parametrize("value", [-0.5, -1e-12, float("inf"), float("-inf"), float("nan")])
def test_bad_alpha_rejected(value):
    with pytest.raises(ConfigError) as info:
        ReconstructionLossConfig(token_weight_alpha=value)
    message = str(info.value)
    assert "token_weight_alpha" in message
    assert repr(value) in message or (math.isnan(value) and "nan" in message)


@pytest.mark.parametrize("value", [0.0, -1e-6, float("nan")])
def test_bad_eps_rejected(value):
    with pytest.raises(ConfigError) as info:
        ReconstructionLossConfig(token_weight_eps=value)
    message = str(info.value)
    assert "ReconstructionLossConfig.token_weight_eps" in message
    assert repr(value) in message


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan"), float("inf")])
def test_bad_scale_rejected(value):
    with pytest.raises(ConfigError) as info:
        ReconstructionLossConfig(zfree_reference_scale=value)
    message = str(info.value)
    assert "ReconstructionLossConfig.zfree_reference_scale" in message
    assert repr(value) in message


def test_valid_edge_values_accepted():
    rec = ReconstructionLossConfig(token_weight_alpha=0.0, token_weight_eps=1e-12, zfree_reference_scale=1e-9)
    assert rec.token_weight_alpha == 0.0
    assert ReconstructionLossConfig().zfree_reference_scale is None
    assert ReconstructionLossConfig().token_weight_eps == 1e-6
    # The default recipe (preset "default") is term 3 only: term 1's default weight is 0 (1 before issue 23).
    assert ReconstructionLossConfig().reconstruction_weight == cfg.PRESETS["default"]["reconstruction_weight"] == 1.0


def test_non_number_rejected():
    with pytest.raises(ConfigError, match=r"token_weight_alpha.*number.*'abc'"):
        ReconstructionLossConfig(token_weight_alpha="abc")
    with pytest.raises(ConfigError, match="reconstruction_weight"):
        ReconstructionLossConfig(reconstruction_weight=True)


def test_validation_through_flags_and_build_config():
    args = make_parser().parse_args(["--token-weighted-reconstruction-alpha", "-1"])
    with pytest.raises(ConfigError, match=r"ReconstructionLossConfig\.token_weight_alpha.*-1\.0"):
        config_from_namespace(args)
    with pytest.raises(ConfigError, match=r"zfree_reference_scale.*0\.0"):
        build_config({"zfree_reference_scale": 0.0})
    with pytest.raises(ConfigError, match="not_a_field"):
        build_config({"not_a_field": 1})


def test_other_sections_validate_and_name_the_field():
    with pytest.raises(ConfigError, match=r"TrainConfig\.batch_size.*0"):
        build_config({"batch_size": 0})
    with pytest.raises(ConfigError, match=r"LatentConfig\.latent.*'bogus'"):
        build_config({"latent": "bogus"})
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--latent", "bogus"])


def test_every_choice_field_refuses_a_value_outside_its_choices():
    """Each ``Literal`` field of every section, found from the hints (no list to keep by hand)."""
    checked = []
    for section in cfg.SECTIONS.values():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            if not cfg.literal_values(hints[f.name]):
                continue
            with pytest.raises(ConfigError, match=rf"{section.__name__}\.{f.name} must be one of .*'bogus'") as caught:
                section(**{f.name: "bogus"})
            assert caught.value.field == f.name
            checked.append(f.name)
    assert {"latent", "encoder_view", "bow_token_weighting", "dtype", "device", "token_weight_source"} <= set(checked)


# ----------------------------------------------------------------------------------------------
# Files and overrides
# ----------------------------------------------------------------------------------------------

NESTED = {
    "reconstruction": {
        "token_weighted_weight": 0.5,
        "token_weight_alpha": 2.0,
        "zfree_reference_scale": 3.5,
        "token_weight_eps": 0.001,
    },
    "train": {"batch_size": 4, "max_steps": 12},
    "latent": {"latent": "continuous", "latent_dim": 8},
}
FLAT = {
    "token_weighted_weight": 0.5,
    "token_weight_alpha": 2.0,
    "zfree_reference_scale": 3.5,
    "token_weight_eps": 0.001,
    "batch_size": 4,
    "max_steps": 12,
    "latent": "continuous",
    "latent_dim": 8,
}


def check_loaded(run: RunConfig) -> None:
    assert run.reconstruction.token_weighted_weight == 0.5
    assert run.reconstruction.token_weight_alpha == 2.0
    assert run.reconstruction.zfree_reference_scale == 3.5
    assert run.reconstruction.token_weight_eps == 0.001
    assert run.train.batch_size == 4
    assert run.train.max_steps == 12
    assert run.latent.latent == "continuous"
    assert run.latent.latent_dim == 8
    assert run.kl == cfg.KLConfig()  # untouched sections keep their defaults


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_config_files_load(tmp_path, layout, suffix):
    data = FLAT if layout == "flat" else NESTED
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    assert read_config_file(path) == FLAT
    args = make_parser().parse_args(["--config", str(path)])
    check_loaded(config_from_namespace(args))


def test_mixed_flat_and_nested_yaml(tmp_path):
    path = tmp_path / "mixed.yaml"
    path.write_text("token_weight_alpha: 2.0\nreconstruction:\n  token_weighted_weight: 0.5\ntrain:\n  batch_size: 4\n")
    run = config_from_namespace(make_parser().parse_args(["--config", str(path)]))
    assert run.reconstruction.token_weight_alpha == 2.0
    assert run.reconstruction.token_weighted_weight == 0.5
    assert run.train.batch_size == 4


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert config_from_namespace(make_parser().parse_args(["--config", str(path)])) == RunConfig()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_flags_override_file(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(NESTED) if suffix == ".json" else yaml.safe_dump(NESTED))
    args = make_parser().parse_args(
        [
            "--config",
            str(path),
            "--token-weighted-reconstruction-alpha",
            "0.25",
            "--zfree-reference-scale",
            "none",
            "--batch-size",
            "2",
            "--latent",
            "discrete",
        ]
    )
    run = config_from_namespace(args)
    assert run.reconstruction.token_weight_alpha == 0.25  # flag
    assert run.reconstruction.zfree_reference_scale is None  # flag back to unset
    assert run.train.batch_size == 2  # flag
    assert run.latent.latent == "discrete"  # flag
    assert run.reconstruction.token_weighted_weight == 0.5  # file
    assert run.reconstruction.token_weight_eps == 0.001  # file
    assert run.train.max_steps == 12  # file
    assert run.latent.latent_dim == 8  # file
    assert run.reconstruction.normalized_inverse_surprisal_token_weighted_weight == 0.0  # default


def test_flag_override_is_validated(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(NESTED))
    args = make_parser().parse_args(["--config", str(path), "--zfree-reference-scale", "-1"])
    with pytest.raises(ConfigError, match=r"zfree_reference_scale.*-1\.0"):
        config_from_namespace(args)


def test_invalid_value_in_file_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reconstruction:\n  token_weight_alpha: -2.0\n")
    with pytest.raises(ConfigError, match=r"ReconstructionLossConfig\.token_weight_alpha.*-2\.0"):
        config_from_namespace(make_parser().parse_args(["--config", str(path)]))


@pytest.mark.parametrize(
    ("suffix", "content", "key"),
    [
        (".yaml", "bogus_key: 1\n", "bogus_key"),
        (".yaml", "reconstruction:\n  bogus_alpha: 1\n", "bogus_alpha"),
        (".yaml", "train:\n  token_weight_alpha: 1.0\n", "token_weight_alpha"),  # field in the wrong section
        (".json", json.dumps({"bogus_key": 1}), "bogus_key"),
        (".json", json.dumps({"reconstruction": {"bogus_alpha": 1}}), "bogus_alpha"),
    ],
)
def test_unknown_key_in_file_names_file_and_key(tmp_path, suffix, content, key):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert str(path) in message and key in message, message
    with pytest.raises(ConfigError) as info:
        config_from_namespace(make_parser().parse_args(["--config", str(path)]))
    assert str(path) in str(info.value) and key in str(info.value)


def test_bad_files(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config_file(broken)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_config_file(not_mapping)


def test_write_and_load_run_config_round_trip(tmp_path):
    run = build_config({**FLAT, "lora_target_modules": ["q_proj", "k_proj"], "straight_through": False})
    path = tmp_path / "resolved.yaml"
    write_run_config(run, path)
    assert load_run_config(path) == run


def test_divergence_needs_the_discrete_latent():
    with pytest.raises(ConfigError, match="divergence_weight.*discrete"):
        build_config({"latent": "continuous", "divergence_weight": 0.1})
    assert build_config({"latent": "discrete", "divergence_weight": 0.1}).divergence.divergence_weight == 0.1


# ----------------------------------------------------------------------------------------------
# Types (every field against its type hint) and duplicate keys
# ----------------------------------------------------------------------------------------------


def field_default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_default_passes_its_own_type_check():
    hints = {}
    for section, cls, f in all_fields():
        hints.setdefault(cls, typing.get_type_hints(cls))
        assert cfg._matches(field_default(f), hints[cls][f.name]), f"{section}.{f.name}"
    for cls in SECTIONS.values():
        cfg._check_types(cls())  # and the check as the sections run it


def wrong_values(hint) -> list:
    """Values of the wrong type for a field of type ``hint`` (Literal fields are _choice's job)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if cfg._is_union(hint) else [hint]
    (base,) = args
    if typing.get_origin(base) is typing.Literal:
        return []
    return {
        bool: ["false", "no", 0, 1, None],
        int: [1.5, 2.0, True, "3", None],
        float: [True, "0.5", [1.0], None],
        str: [5, 1.5, ["a"], True, None],
        list[str]: ["q_proj", ["q_proj", 3], ("q_proj",), None],
    }[base]


def type_cases():
    for _section, cls, f in all_fields():
        hint = typing.get_type_hints(cls)[f.name]
        for value in wrong_values(hint):
            if value is None and type(None) in typing.get_args(hint):
                continue  # an optional field takes None
            yield pytest.param(cls, f.name, value, id=f"{f.name}={value!r}")


@pytest.mark.parametrize(("cls", "name", "value"), list(type_cases()))
def test_every_field_rejects_a_wrong_type_naming_it(cls, name, value):
    with pytest.raises(ConfigError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}.{name} must be "), message
    assert repr(value) in message and f"({type(value).__name__})" in message, message
    assert info.value.field == name


def test_type_messages():
    with pytest.raises(ConfigError) as info:
        build_config({"feature_cache": "no"})
    assert str(info.value) == "TrainConfig.feature_cache must be a boolean (true/false), got 'no' (str)"
    with pytest.raises(ConfigError, match=r"DataConfig\.max_examples must be an integer or null, got 1\.5 \(float\)"):
        build_config({"max_examples": 1.5})
    with pytest.raises(
        ConfigError, match=r"lora_target_modules must be a list of strings or null, got 'q_proj' \(str\)"
    ):
        build_config({"lora_target_modules": "q_proj"})
    with pytest.raises(ConfigError, match=r"\(item 3 is int\)"):
        build_config({"lora_target_modules": ["q_proj", 3]})


def test_floats_accept_ints_and_optional_fields_accept_none():
    run = build_config({"lora_alpha": 16, "beta": 0, "zfree_reference_scale": 2, "max_examples": None, "model": None})
    assert run.model.lora_alpha == 16 and run.kl.beta == 0 and run.reconstruction.zfree_reference_scale == 2
    # an empty list of LoRA modules is a list of strings (a frozen decoder needs none; LoRA refuses it)
    assert build_config({"lora_target_modules": [], "preset": "frozen"}).model.lora_target_modules == []


def test_typed_flags_pass_the_type_check():
    args = make_parser().parse_args(
        ["--max-steps", "3", "--beta", "1", "--no-chat-template", "--lora-target-modules", "q_proj", "k_proj"]
        + ["--max-examples", "5", "--model", "some/dir", "--resume", "none", "--no-feature-cache"]
    )
    run = config_from_namespace(args)
    assert run.train.max_steps == 3 and run.kl.beta == 1.0 and run.data.chat_template is False
    assert run.model.lora_target_modules == ["q_proj", "k_proj"] and run.data.max_examples == 5
    assert run.model.model == "some/dir" and run.train.resume is None and run.train.feature_cache is False


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('chat_template: "false"\n', "DataConfig.chat_template must be a boolean (true/false), got 'false' (str)"),
        ("train:\n  feature_cache: 'no'\n", "TrainConfig.feature_cache must be a boolean (true/false), got 'no' (str)"),
        ("output_dir: 5\n", "TrainConfig.output_dir must be a string, got 5 (int)"),
        ("model: [a, b]\n", "ModelConfig.model must be a string or null, got ['a', 'b'] (list)"),
        ("data:\n  data: 3\n", "DataConfig.data must be a string, got 3 (int)"),
        (
            "lora_target_modules: q_proj\n",
            "ModelConfig.lora_target_modules must be a list of strings or null, got 'q_proj'",
        ),
        ("max_steps: 1.5\n", "TrainConfig.max_steps must be an integer, got 1.5 (float)"),
        ("batch_size: true\n", "TrainConfig.batch_size must be an integer, got True (bool)"),
        ("kl:\n  beta: -1\n", "KLConfig.beta must be >= 0, got -1"),
    ],
)
def test_bad_value_in_file_names_the_file(tmp_path, content, expected):
    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        config_from_namespace(make_parser().parse_args(["--config", str(path)]))
    assert str(info.value).startswith(f"config file {path}: "), str(info.value)
    assert expected in str(info.value)


def test_bad_flag_over_a_file_does_not_blame_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("beta: 0.5\n")
    with pytest.raises(ConfigError) as info:
        config_from_namespace(make_parser().parse_args(["--config", str(path), "--beta", "-1"]))
    assert str(info.value).startswith("KLConfig.beta must be >= 0"), str(info.value)
    path.write_text('chat_template: "false"\n')  # a bad file value that a flag replaces is no error
    args = make_parser().parse_args(["--config", str(path), "--chat-template"])
    assert config_from_namespace(args).data.chat_template is True


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("flat.yaml", "beta: 0.1\nmax_steps: 3\nbeta: 0.2\n", "duplicate key 'beta' on line 3 (first on line 1)"),
        ("nested.yaml", "kl:\n  beta: 0.1\n  beta: 0.2\n", "duplicate key 'beta' on line 3 (first on line 2)"),
        ("section.yaml", "kl:\n  beta: 0.1\nkl:\n  free_bits: 1.0\n", "duplicate key 'kl' on line 3"),
        ("flat.json", '{"beta": 0.1, "beta": 0.2}', "duplicate key 'beta'"),
        ("nested.json", '{"kl": {"beta": 0.1, "beta": 0.2}}', "duplicate key 'beta'"),
        ("both.yaml", "beta: 0.1\nkl:\n  beta: 0.2\n", "field 'beta' is given twice (as 'beta' and as 'kl.beta')"),
        ("both.json", '{"kl": {"beta": 0.1}, "beta": 0.2}', "field 'beta' is given twice (as 'kl.beta' and as 'beta')"),
    ],
)
def test_duplicate_keys_in_a_config_file_are_an_error(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    assert str(info.value).startswith(f"config file {path}: "), str(info.value)
    assert expected in str(info.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("kl: &k\n  beta: 0.1\n  free_bits: 0.5\ntrain:\n  max_steps: 3\nlatent:\n  latent: discrete\n")
    assert read_config_file(path)["beta"] == 0.1
    path.write_text("x: &d {beta: 0.1}\n")  # anchors themselves are fine; the unknown key is the error
    with pytest.raises(ConfigError, match="unknown key 'x'"):
        read_config_file(path)
    path.write_text("kl:\n  <<: {beta: 0.1, free_bits: 0.5}\n  beta: 0.2\n")
    assert read_config_file(path) == {"beta": 0.2, "free_bits": 0.5}


def test_non_utf8_and_non_mapping_sections(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("output_dir: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {re.escape(str(path))} is not UTF-8 text"):
        read_config_file(path)
    path = tmp_path / "section.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="section 'train' must be a mapping"):
        read_config_file(path)


def test_default_config_file_loads():
    for path in sorted((Path(__file__).parent.parent / "configs").glob("*.y*ml")):
        assert isinstance(load_run_config(path), RunConfig), path


def test_yaml_floats_need_no_dot(tmp_path):
    from disentanglement.config import read_config_file, resolve_config

    path = tmp_path / "run.yaml"
    path.write_text("encoder_lr: 1e-3\nlatent_lr: 3E+1\ntoken_weight_eps: 1.0e-6\nmodel: 1e3x\n")
    values = read_config_file(path)
    assert values == {"encoder_lr": 1e-3, "latent_lr": 30.0, "token_weight_eps": 1e-6, "model": "1e3x"}
    path.write_text("encoder_lr: 1e-3\nmax_steps: 1e2\n")
    with pytest.raises(ConfigError, match="max_steps must be an integer, got 100.0"):
        resolve_config(path)
