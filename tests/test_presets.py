"""One set of defaults (issue 23): the dataclass defaults are the "default" preset, configs/default.yaml adds only
the main job's data, model and output, ``--preset NAME`` picks a named recipe, and the order is
dataclass defaults < preset < config file < flags."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from disentanglement import cli
from disentanglement.config import (
    FIELDS,
    PRESETS,
    RECIPE_FIELDS,
    ConfigError,
    build_config,
    resolve_config,
)
from disentanglement.sweep import build_spec
from helpers import flat, recipe

ROOT = Path(__file__).parent.parent
DEFAULT_YAML = ROOT / "configs" / "default.yaml"

#: The default recipe, written out here independently of config.PRESETS (docs/what-the-cvae-adds.md, sections 8 and
#: 33: centered-lora-240).
MEASURED = {
    "reconstruction_weight": 1.0,
    "sequence_reconstruction_weight": 0.0,
    "token_weighted_weight": 1.0,
    "normalized_concentration_corrected_token_weighted_weight": 0.0,
    "normalized_inverse_surprisal_token_weighted_weight": 0.0,
    "zfree_relative_weight": 0.0,
    "token_weight_alpha": 2.0,
    "encoder_view": "token_weighted",
    "centered_straight_through": None,  # centred wherever there is a nearest code (RunConfig.centers_straight_through)
    "decoder_training": "lora",
    "decoder_lr": 1e-3,
    "latent_placement": "prefix",
    "codebook_init": "kmeans",
    "decoder_posterior_weight": 0.0,
    "decoder_posterior_start": 0,
    "decoder_posterior_target": "hard",
    "max_steps": 240,
}
#: The default before section 33 (preset frozen): the same objective and view, the decoder frozen, 200 steps.
FROZEN = dict(MEASURED, centered_straight_through=False, decoder_training="frozen", decoder_lr=1e-4, max_steps=200)
#: The seed notes' recipe: the token-weighted term beside the raw one, alpha 1, the mean view.
SEED = dict(FROZEN, reconstruction_weight=1.0, token_weighted_weight=1.0, token_weight_alpha=1.0)
#: Term 3 alone at alpha 2 with the same view: the default before issue 22.
TERM3 = dict(FROZEN, reconstruction_weight=0.0)
SEED["encoder_view"] = "mean_last"
#: What configs/default.yaml trains: its settings of issue 23, with the default recipe.
MAIN_JOB = {
    "model": None,
    "data": "chatterbot",
    "chat_template": True,
    "max_prompt_tokens": 64,
    "max_response_tokens": 48,
    "validation_fraction": 0.1,
    "latent": "discrete",
    "num_slots": 1,
    "codebook_size": 8,
    "latent_tokens": 4,
    "assignment": "nearest",
    "beta": 0.02,
    "beta_schedule": "linear",
    "beta_warmup_steps": 50,
    "output_dir": "runs/default",
    "batch_size": 8,
    "encoder_lr": 1e-3,
    "latent_lr": 3e-2,
    "save_every": 50,
    "eval_every": 100,
    "seed": 0,
    **MEASURED,
}
#: The only fields configs/default.yaml may set to something other than the defaults: data, model, output.
MAIN_JOB_OWN = {"data", "max_response_tokens", "codebook_size", "output_dir"}


def train_config(argv: list[str]):
    """The config ``disentangle train ARGV`` would train, without training."""
    return cli._train_config(cli.build_parser().parse_args(["train", *argv]))


def test_bare_defaults_are_the_default_preset_and_the_measured_recipe():
    assert recipe(build_config({})) == MEASURED
    assert PRESETS["default"] == MEASURED
    assert flat(build_config({"preset": "default"})) == flat(build_config({}))
    assert build_config({}).train.max_steps == 240  # one figure everywhere (the flag's default was 300)
    assert build_config({}).centers_straight_through  # null: centred, the main job's latent has nearest codes
    assert recipe(train_config(["--data", "mine.jsonl"])) == MEASURED  # a bare train on the user's data


def test_default_yaml_is_the_defaults_plus_the_main_jobs_data_model_and_output():
    main_job = flat(resolve_config(DEFAULT_YAML))
    assert recipe(resolve_config(DEFAULT_YAML)) == MEASURED
    assert {k: main_job[k] for k in MAIN_JOB} == MAIN_JOB
    defaults = flat(build_config({}))
    differs = {k for k in FIELDS if main_job[k] != defaults[k]}
    assert differs <= MAIN_JOB_OWN, differs - MAIN_JOB_OWN
    assert "token_weight_alpha" not in DEFAULT_YAML.read_text()  # the recipe lives in config.py only


def test_preset_seed_gives_the_seed_recipe():
    assert recipe(train_config(["--preset", "seed"])) == SEED
    assert recipe(build_config({"preset": "seed"})) == SEED
    # every other field keeps its default
    seeded, bare = flat(build_config({"preset": "seed"})), flat(build_config({}))
    assert {k for k in FIELDS if seeded[k] != bare[k]} <= set(RECIPE_FIELDS)


def test_preset_term3_gives_term_3_alone():
    assert recipe(build_config({"preset": "term3"})) == TERM3
    assert TERM3["reconstruction_weight"] == 0.0 and TERM3["token_weighted_weight"] == 1.0


def test_every_preset_sets_the_whole_recipe_and_validates():
    for name, values in PRESETS.items():
        assert set(values) == set(RECIPE_FIELDS), name
        assert recipe(build_config({"preset": name})) == values


def test_preset_centered_full_is_the_frozen_recipe_with_the_centred_gradient_and_the_whole_decoder():
    """Section 12's recipe (run.py's centered-full), by flag and by file."""
    want = dict(FROZEN, centered_straight_through=True, decoder_training="full", decoder_lr=5e-5)
    assert recipe(train_config(["--preset", "centered-full"])) == want
    assert recipe(build_config({"preset": "centered-full"})) == want
    # the flags run.py passes for it give the same config
    by_flags = train_config(
        ["--preset", "frozen", "--centered-straight-through", "--decoder-training", "full", "--decoder-lr", "5e-5"]
    )
    assert flat(by_flags) == flat(build_config({"preset": "centered-full"}))


def test_preset_frozen_is_the_default_before_section_33_and_centered_lora_the_default():
    assert recipe(build_config({"preset": "frozen"})) == recipe(train_config(["--preset", "frozen"])) == FROZEN
    assert recipe(build_config({"preset": "centered-lora"})) == MEASURED
    # run.py's centered-lora-240 (the frozen base's flags): the default, centred by name rather than by null
    lora_240 = [
        "--centered-straight-through",
        "--decoder-training",
        "lora",
        "--decoder-lr",
        "1e-3",
        "--max-steps",
        "240",
    ]
    by_flags = train_config(["--preset", "frozen", *lora_240])
    assert recipe(by_flags) == dict(MEASURED, centered_straight_through=True)
    assert by_flags.centers_straight_through == build_config({}).centers_straight_through is True


def test_the_default_centring_follows_the_latent():
    """null centres where the nearest code's straight-through exists, so the default recipe trains every latent."""
    cases = [
        ({}, True),
        ({"latent": "continuous"}, False),
        ({"assignment": "gumbel"}, False),
        ({"batch_size": 1}, False),
        ({"preset": "frozen"}, False),
    ]
    for values, centred in cases:
        assert build_config(values).centers_straight_through is centred, values
    for given in (True, False):
        assert build_config({"centered_straight_through": given}).centers_straight_through is given
    # given true, where there is nothing to centre, it is refused rather than ignored
    with pytest.raises(ConfigError, match="centered_straight_through .*needs the discrete latent"):
        build_config({"centered_straight_through": True, "latent": "continuous"})
    with pytest.raises(ConfigError, match="batch_size >= 2"):
        build_config({"centered_straight_through": True, "batch_size": 1})


def test_the_centring_flag_takes_true_false_and_null(capsys):
    assert train_config(["--centered-straight-through"]).latent.centered_straight_through is True
    assert train_config(["--no-centered-straight-through"]).latent.centered_straight_through is False
    for text, value in (("true", True), ("false", False), ("null", None), ("none", None)):
        config = train_config(["--preset", "frozen", "--centered-straight-through", text])
        assert config.latent.centered_straight_through is value, text
    for argv, message in (
        (["--centered-straight-through", "maybe"], "invalid choice: 'maybe'"),
        (["--no-centered-straight-through=true"], "--no-centered-straight-through takes no value, got 'true'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_precedence_defaults_then_preset_then_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: seed\nreconstruction:\n  token_weight_alpha: 0.5\n")
    from_file = train_config(["--config", str(path)])
    assert from_file.reconstruction.token_weighted_weight == 1.0  # the file's preset over the defaults (0 -> 1)
    assert from_file.latent.encoder_view == "mean_last"  # the file's preset over the defaults
    assert from_file.reconstruction.token_weight_alpha == 0.5  # the file over its preset (1)

    flags = train_config(["--config", str(path), "--preset", "raw", "--reconstruction-weight", "3"])
    assert flags.reconstruction.token_weighted_weight == 0.0  # the flag's preset replaces the file's (seed: 1)
    assert flags.reconstruction.token_weight_alpha == 0.5  # the file's own field still beats any preset (raw: 1)
    assert flags.reconstruction.reconstruction_weight == 3.0  # a flag beats everything (raw: 1)
    assert flags.latent.encoder_view == "mean_last"  # raw's view, not the default's token_weighted

    assert train_config(["--preset", "seed", "--encoder-view", "attention"]).latent.encoder_view == "attention"
    assert resolve_config(path, {"token_weight_alpha": 3.0}).reconstruction.token_weight_alpha == 3.0


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, err.getvalue()


def test_unknown_preset_is_a_clear_error(tmp_path):
    code, err = _run(["train", "--preset", "sede", "--output-dir", str(tmp_path / "run")])
    assert code == 2
    assert err.count("\n") == 1 and "unknown preset 'sede'" in err
    for name in PRESETS:
        assert f"{name}: " in err  # every preset listed with what it is
    assert not (tmp_path / "run").exists()

    path = tmp_path / "run.yaml"
    path.write_text("preset: fast\n")
    code, err = _run(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")])
    assert code == 2 and f"config file {path}: unknown preset 'fast'" in err
    with pytest.raises(ConfigError, match="unknown preset 3"):
        build_config({"preset": 3})


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_presets_are_listed_in_help(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--preset PRESET" in text
    for name in PRESETS:
        assert name in text
    if command == "train":
        assert "terms 1 + 3 at alpha 2" in text and "terms 1 + 3 at alpha 1" in text
        assert "term 3 only at alpha 2" in text
        assert "--preset < the --config file < flags" in text


def test_sweep_takes_a_preset_in_the_base_and_in_a_cell():
    spec = build_spec({"preset": "seed", "token_weight_alpha": 0.5}, ["s", "r preset=raw"], seeds=[0])
    seed_cell, raw_cell = (spec.config(c, 0, Path("out")) for c in ("s", "r"))
    assert recipe(seed_cell) == dict(SEED, token_weight_alpha=0.5)
    assert raw_cell.reconstruction.token_weighted_weight == 0.0 and raw_cell.reconstruction.token_weight_alpha == 0.5
    with pytest.raises(ConfigError, match="sweep: cell 'x': unknown preset 'nope'"):
        build_spec({}, ["x preset=nope"], seeds=[0])


def test_a_preset_given_with_resume_goes_over_the_stored_recipe(tmp_path):
    """--resume starts from the run's stored config; a --preset given now must not sit silently under it."""
    from disentanglement.config import write_run_config

    run = tmp_path / "run"
    run.mkdir()
    write_run_config(build_config({"output_dir": str(run), "preset": "frozen"}), run / "config.yaml")
    assert recipe(train_config(["--resume", "auto", "--output-dir", str(run)])) == FROZEN  # as stored
    assert recipe(train_config(["--resume", "auto", "--output-dir", str(run), "--preset", "seed"])) == SEED
    flagged = train_config(
        ["--resume", "auto", "--output-dir", str(run), "--preset", "seed", "--encoder-view", "token_weighted"]
    )
    assert recipe(flagged) == dict(SEED, encoder_view="token_weighted")  # flags still over the preset


def test_a_preset_given_with_resume_keeps_the_runs_decoder_training(tmp_path):
    """A preset on --resume changes the objective only: a LoRA run resumed with --preset seed stays a LoRA run
    (the preset's frozen decoder would be refused by resume), and its decoder_lr and centring stay the run's."""
    from disentanglement.config import write_run_config

    run = tmp_path / "run"
    run.mkdir()
    stored = {"output_dir": str(run), "preset": "seed", "decoder_training": "lora", "decoder_lr": 5e-4}
    write_run_config(build_config({**stored, "centered_straight_through": True}), run / "config.yaml")
    for preset in ("seed", "centered-lora", "default"):
        resumed = flat(train_config(["--resume", "auto", "--output-dir", str(run), "--preset", preset]))
        kept = {k: resumed[k] for k in ("decoder_training", "decoder_lr", "centered_straight_through")}
        assert kept == {"decoder_training": "lora", "decoder_lr": 5e-4, "centered_straight_through": True}, preset
        assert resumed["encoder_view"] == PRESETS[preset]["encoder_view"]  # the objective is the preset's


#: Section 20's recipe (configs/steer.yaml, run.py's centered-full-between-random-dpost-hard-late), written out.
STEER = dict(
    MEASURED,
    centered_straight_through=True,
    decoder_training="full",
    decoder_lr=5e-5,
    latent_placement="between",
    codebook_init="random",
    decoder_posterior_weight=1.0,
    decoder_posterior_start=180,
    decoder_posterior_target="hard",
    max_steps=240,
)


def test_preset_steer_is_section_20s_recipe_by_flag_file_and_over_the_main_job():
    assert PRESETS["steer"] == STEER
    assert recipe(train_config(["--preset", "steer"])) == STEER
    assert recipe(build_config({"preset": "steer"})) == STEER
    # over the main job's file: its data, model, K and output, the steer recipe (the file sets no recipe field)
    main_job = train_config(["--config", str(DEFAULT_YAML), "--preset", "steer"])
    assert recipe(main_job) == STEER
    assert main_job.latent.codebook_size == 8 and main_job.data.data == "chatterbot"
    # a flag still goes over the preset; a shorter run must move the term's start (or the term is refused)
    assert train_config(["--preset", "steer", "--max-steps", "400"]).train.max_steps == 400
    with pytest.raises(ConfigError, match="decoder_posterior_start.*never run") as error:
        train_config(["--preset", "steer", "--max-steps", "120"])
    assert error.value.field == "decoder_posterior_start"
    short = train_config(["--preset", "steer", "--max-steps", "120", "--decoder-posterior-start", "90"])
    assert (short.train.max_steps, short.latent.decoder_posterior_start) == (120, 90)
    # the preset's parts that need one nearest code are refused, by name, with another latent
    with pytest.raises(ConfigError) as error:
        build_config({"preset": "steer", "latent": "continuous"})
    assert error.value.field in {"centered_straight_through", "decoder_posterior_weight", "codebook_init"}


def test_a_steer_run_of_fewer_steps_resumes_with_its_preset(tmp_path):
    """Resuming validates the stored run with the preset's objective over it, not the preset alone: a steer run of
    120 steps whose term started at 90 resumes with --preset steer (the preset alone, start 180, would be refused),
    keeping its placement, codebook start, decoder-posterior fields and steps."""
    from disentanglement.config import write_run_config

    run = tmp_path / "run"
    run.mkdir()
    stored = {"output_dir": str(run), "preset": "steer", "max_steps": 120, "decoder_posterior_start": 90}
    write_run_config(build_config(stored), run / "config.yaml")
    resumed = flat(train_config(["--resume", "auto", "--output-dir", str(run), "--preset", "steer"]))
    kept = ("latent_placement", "codebook_init", "decoder_posterior_weight", "decoder_posterior_start", "max_steps")
    assert {k: resumed[k] for k in kept} == {k: v for k, v in dict(STEER, **stored).items() if k in kept}
    assert recipe(train_config(["--resume", "auto", "--output-dir", str(run)]))["decoder_posterior_start"] == 90
    # a preset with another placement changes the objective only: the run's own fields stay
    seeded = flat(train_config(["--resume", "auto", "--output-dir", str(run), "--preset", "seed"]))
    assert {k: seeded[k] for k in kept} == {k: resumed[k] for k in kept}
    assert seeded["encoder_view"] == "mean_last"


def test_every_preset_but_steer_keeps_the_code_before_the_prompt_and_200_steps_but_the_default():
    """The fields presets gained with steer are, in every other preset, the values they had as dataclass defaults:
    those presets resolve as before. The default (and centered-lora, its name in the tables) trains 240 steps."""
    new = ("latent_placement", "codebook_init", "decoder_posterior_weight", "decoder_posterior_start",
           "decoder_posterior_target", "max_steps")  # fmt: skip
    for name, values in PRESETS.items():
        if name != "steer":
            steps = 240 if name in ("default", "centered-lora") else 200
            assert {k: values[k] for k in new} == dict({k: FROZEN[k] for k in new}, max_steps=steps), name


def test_sweep_cell_with_preset_steer_and_a_base_that_sets_the_steps():
    spec = build_spec({}, ["f", "s preset=steer"], seeds=[0])
    default, steer = (spec.config(c, 0, Path("out")) for c in ("f", "s"))
    assert recipe(default) == MEASURED and recipe(steer) == STEER
    longer = build_spec({"max_steps": 400}, ["s preset=steer"], seeds=[0]).config("s", 0, Path("out"))
    assert recipe(longer) == dict(STEER, max_steps=400)  # the base's steps win over the cell's preset
    with pytest.raises(ConfigError, match="cell 's'.*decoder_posterior_start.*never run"):
        build_spec({"max_steps": 120}, ["s preset=steer"], seeds=[0])


@pytest.mark.parametrize(("latent", "centred"), [("discrete", True), ("continuous", False)])
def test_the_default_recipe_builds_and_trains_either_latent(latent, centred):
    """The default on a tiny Llama: LoRA adapters on the decoder (the reference: the adapters off), the discrete
    model centring its straight-through and the continuous one not (null: where there is one); one backward reaches
    the adapters from their zero start and the encoder, and none of the model's own weights."""
    from disentanglement.data import collate
    from helpers import tiny_cvae, tiny_tokenizer, view_pairs

    tokenizer = tiny_tokenizer(chat_template=False)
    model, examples, config = tiny_cvae(tokenizer, view_pairs(), latent=latent)
    assert config.latent.centered_straight_through is None and config.centers_straight_through is centred
    assert model.decoder_training == "lora" and model.latent_cfg.centered_straight_through is centred
    model.train()
    model(collate(examples[:6], tokenizer.pad_token_id)).loss.backward()
    adapters = {n: p for n, p in model.decoder.named_parameters() if "lora_B" in n}
    assert adapters and all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.values())
    assert all(p.grad is None for n, p in model.decoder.named_parameters() if "lora_" not in n)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameter_groups()["encoder"])


def test_lora_target_modules_null_is_peft_s_choice_and_a_wrong_list_names_the_field():
    """null: peft's projections for the architecture (q_proj and v_proj on Llama, c_attn on GPT-2); a list that
    names no module of the model is a ConfigError naming the field and the model type, not peft's own error."""
    from disentanglement.models import build_cvae
    from helpers import tiny_gpt2, tiny_llama, tiny_tokenizer

    vocab = len(tiny_tokenizer(chat_template=False))
    for decoder, targets in ((tiny_llama(vocab), {"q_proj", "v_proj"}), (tiny_gpt2(vocab), {"c_attn"})):
        model = build_cvae(build_config({}), decoder)
        adapted = {n.split(".")[-4] for n, _ in model.decoder.named_parameters() if "lora_A" in n}
        assert adapted == targets, type(decoder).__name__
    with pytest.raises(ConfigError, match=r"lora_target_modules \(\['nope'\]\).*LlamaForCausalLM.*'llama'") as error:
        build_cvae(build_config({"lora_target_modules": ["nope"]}), tiny_llama(vocab))
    assert error.value.field == "lora_target_modules"
    # the flag: a list, or none alone for null
    assert train_config(["--lora-target-modules", "q_proj", "k_proj"]).model.lora_target_modules == ["q_proj", "k_proj"]
    assert train_config(["--lora-target-modules", "none"]).model.lora_target_modules is None
    with pytest.raises(SystemExit):  # none among names: neither the list nor null
        train_config(["--lora-target-modules", "q_proj", "none"])
