"""The latent learns what it should: on the real embedded model (frozen SmolLM2-135M-Instruct) and
synthetic data whose response form is chosen by a hidden factor that the prompt does not reveal,
80-120 CPU steps make the argmax code (discrete) or k-means of the posterior means
(continuous) recover the factor, and the conditioned reconstruction beat the z-free reference.

Also the slow smoke test of the real defaults: the embedded model and the chatterbot corpus, and the
same recovery with the memory placement on the tiny model of the shared fixtures (``conftest._train``,
the fastest learning setup).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import _train, model_and_tokenizer
from disentanglement.commands import run_eval
from disentanglement.config import ModelConfig, build_config
from disentanglement.data import load_chatterbot
from disentanglement.evaluation import example_factor_values, factor_agreements, posterior_latents
from disentanglement.features import FeatureCache
from disentanglement.lm import load_model_and_tokenizer
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import train

LEARNING_SETTINGS = dict(
    preset="raw",  # the recipe these thresholds were measured with (the defaults before issue 23)
    max_examples=600,
    validation_fraction=0.34,  # about 200 held-back pairs, as in LATENT-LEARNING.md
    chat_template=False,  # shorter sequences: the factor is in the response, not the prompt format
    batch_size=8,
    eval_every=1000,
    save_every=1000,
    progress=False,
)


NUM_VALUES = 4  # the hidden factor's values


@pytest.fixture(scope="module")
def embedded():
    torch.manual_seed(0)
    # the dtype the main job runs in (auto: bf16 on a CPU with AMX-BF16 or AVX512-BF16, else float32); the step
    # counts below were measured in each
    return load_model_and_tokenizer(ModelConfig(dtype="auto"))


@pytest.fixture(scope="module")
def hidden_factor_pairs():
    prompts = [pair.prompt for pair in load_chatterbot()]
    return make_hidden_factor_pairs(prompts, num_factors=NUM_VALUES, kind="clean", seed=0)


def validation_cache(result) -> FeatureCache:
    return result.cache.subset(len(result.data.train), len(result.cache))


# Steps per latent and dtype. float32: the discrete latent's path depends on the CPU's float32 kernels: on an
# AVX2 CPU 100 and 120 steps gave NMI 1.000 and 0.965 (2026-12-03), on an AVX512 one 100, 120, 160 and 200 steps
# gave 0.941, 0.794 (two codes for one value), 1.000 and 1.000 (reconstruction 0.25, 0.12, 0.003 and 0.003 of the
# z-free one; 2026-12-04); the continuous latent 60 and 80 steps 0.98 and 1.000 (0.18 and 0.04) on the AVX512 CPU,
# on an AMX one 80, 120 and 160 steps 0.799 (two values in one cluster), 0.903 and 1.000 (0.09; 2026-12-05).
# bf16 on the AMX CPU (2026-12-06, seed 0 unless said): discrete 100, 120, 150, 200 steps all 1.000
# (reconstruction 0.21, 0.016, 0.003, 0.002 of the z-free one), 120 steps on seeds 1 and 2 1.000 (0.11, 0.006);
# continuous 80, 120, 160 steps 1.000 (0.068, 0.013, 0.088), 100 steps on seeds 1 and 2 1.000 (0.027, 0.032), but
# 100 steps after the discrete run in this module 0.970 (0.052): 120. bf16 takes a third of float32's time.
LEARNING_STEPS = {
    ("discrete", torch.float32): 200,
    ("continuous", torch.float32): 160,
    ("discrete", torch.bfloat16): 120,
    ("continuous", torch.bfloat16): 120,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("latent", "options"),
    [("discrete", {"centered_straight_through": True}), ("continuous", {})],
    ids=["discrete", "continuous"],
)
def test_latent_recovers_the_hidden_factor(tmp_path, embedded, hidden_factor_pairs, latent, options):
    """The discrete latent with the centred straight-through (raw reconstruction's codes collapse onto one code
    for tens of steps without it: 80 steps in float32, NMI 0.49) and the continuous latent recover the hidden
    factor from raw reconstruction on the embedded model, in the dtype the main job runs in."""
    decoder, tokenizer = embedded
    steps = LEARNING_STEPS[latent, decoder.dtype]
    settings = dict(
        LEARNING_SETTINGS,
        latent=latent,
        max_steps=steps,
        output_dir=str(tmp_path),
        dtype=str(decoder.dtype).removeprefix("torch."),
        **options,
    )
    config = build_config(settings)
    result = train(config, (decoder, tokenizer), hidden_factor_pairs)
    cache = validation_cache(result)
    # the latent's NMI beside the trivial baseline, as eval scores it: k-means of the frozen view the encoder reads
    # (preset raw's mean_last view). It is 1.000 on this data, so it is printed, not asserted: the memory test
    # below holds the comparison with the baseline
    latents = posterior_latents(result.model, result.data.validation, cache, tokenizer.pad_token_id)
    factors = example_factor_values(result.data.validation)
    (agreement,) = factor_agreements(result.model, latents, factors, cache).values()
    nmi, view = agreement["latent"]["nmi"], agreement["encoder_kmeans"]["nmi"]
    zfree = float(cache.example_base_losses().mean())
    conditioned = result.last_metrics["val_reconstruction_loss"]
    print(
        f"{latent}: NMI {nmi:.3f} (k-means of its view {view:.3f}), reconstruction {conditioned:.3f} "
        f"vs z-free {zfree:.3f} nats/token"
    )
    assert nmi >= 0.9, agreement["contingency"]
    assert conditioned < 0.25 * zfree
    # The frozen decoder is untouched: the shared model object is reused by the next test.
    assert all(not p.requires_grad for p in decoder.parameters())


@pytest.mark.slow
def test_real_defaults_train_a_few_steps(tmp_path, embedded):
    """The embedded model with the chatterbot corpus and the chat template, as the main job runs it: the default
    recipe's LoRA adapters (on a copy: the module's model stays frozen) train, the model's own weights do not."""
    decoder, tokenizer = embedded
    decoder = copy.deepcopy(decoder)
    before = {name: p.detach().clone() for name, p in decoder.named_parameters()}
    config = build_config(
        dict(
            output_dir=str(tmp_path),
            max_steps=3,
            max_examples=48,
            batch_size=4,
            eval_every=3,
            eval_batches=1,
            progress=False,
            token_weighted_weight=1.0,
        )
    )
    assert config.model.decoder_training == "lora" and config.centers_straight_through
    result = train(config, (decoder, tokenizer))
    assert result.final_step == 3 and result.checkpoint is not None
    adapters = {n: p for n, p in result.model.decoder.named_parameters() if "lora_B" in n}
    assert adapters and all(p.abs().sum() > 0 for p in adapters.values())  # B starts at zero and moved
    for name, p in result.model.decoder.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name.replace(".base_layer", "")]), name
    assert result.data.stats["chat_template"] is True
    assert 1.0 < result.zfree_reference_scale < 8.0  # nats per token of a real LM on dialogue
    for key in ("loss", "reconstruction_loss", "token_weighted_reconstruction_loss", "val_reconstruction_loss"):
        assert key in result.last_metrics and result.last_metrics[key] == result.last_metrics[key]


def test_memory_latent_recovers_the_hidden_factor(tmp_path):
    """``latent_placement: memory`` on the fixtures' tiny Llama and recipe (discrete, 400 steps): the argmax
    code recovers the hidden factor with the thresholds above, beats k-means of the frozen encoder and
    prior features and a random assignment, and the conditioned reconstruction beats the z-free one."""
    run = _train(tmp_path / "memory", "discrete", 400, latent_placement="memory")
    report, _, _ = run_eval(
        run.checkpoint, output=tmp_path / "eval.json", progress=False, model_and_tokenizer=model_and_tokenizer()
    )
    entry = report["factors"]["label"]
    conditioned = report["reconstruction_terms"]["reconstruction_loss"]
    zfree = report["zfree_nll_nats_per_token"]
    print(
        f"memory: NMI {entry['latent']['nmi']:.3f} (encoder k-means {entry['encoder_kmeans']['nmi']:.3f}, prior "
        f"k-means {entry['prior_kmeans']['nmi']:.3f}), reconstruction {conditioned:.3f} vs z-free {zfree:.3f} "
        f"nats/token, {run.seconds:.1f} s"
    )
    assert report["label_nmi"] >= 0.9, report["label_contingency"]
    assert entry["latent_beats_baselines"] is True
    assert conditioned < 0.25 * zfree
    assert report["latent_gain_nats_per_token"] > 0
