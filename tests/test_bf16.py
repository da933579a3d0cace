"""bf16 decoder weights: where ``dtype: auto`` chooses them, and that everything but the decoder stays float32.

The decoder (frozen, or LoRA's base) may run in bf16; the CVAE's heads, latent parameters, optimizer
state, the log-softmax over the vocabulary, the six terms, the token weights and their statistics,
``c_base``, ``kappa`` and KL are float32 whatever the decoder's dtype. Tiny in-process models only.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import disentanglement.lm as lm
from disentanglement.config import ModelConfig, build_config
from disentanglement.cvae_base import WeightingParams
from disentanglement.data import Example, collate
from disentanglement.features import (
    _WEIGHTING_STATISTICS,
    build_feature_cache,
    feature_fingerprint,
    load_feature_cache,
    load_or_build_feature_cache,
)
from disentanglement.losses import TERM_WEIGHT_FIELDS, estimate_zfree_reference_scale
from disentanglement.models import build_cvae
from disentanglement.testing import make_hidden_factor_pairs
from disentanglement.trainer import load_trained, make_optimizer, train
from helpers import tiny_llama, tiny_tokenizer, trainer_config

ALL_TERMS = {field: 1.0 for field in TERM_WEIGHT_FIELDS.values()}


def examples(count: int = 24, vocab: int = 103, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 16))]
        out.append(Example(prompt, response, None, f"synthetic:#{i}"))
    return out


def peaked_llama(vocab: int = 103, seed: int = 0):
    """The tiny Llama with its LM head scaled up: peaked next-token distributions (``kappa`` well above 1)
    and logits of the size a trained LM gives, where bf16 rounding shows."""
    model = tiny_llama(vocab, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


# -- detection and resolve_dtype ---------------------------------------------------------------------------
def _torch_checks(monkeypatch, amx: bool | None, avx512_bf16: bool | None) -> None:
    """Set torch.cpu's checks (None: this torch has no such check), with oneDNN present (as on a torch
    built without it the answer is False whatever the CPU says)."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    for name, value in (("_is_amx_tile_supported", amx), ("_is_avx512_bf16_supported", avx512_bf16)):
        if value is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda value=value: value)


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [(True, False, True), (False, True, True), (True, True, True), (False, False, False)],
)
def test_fast_bf16_from_torchs_own_checks(monkeypatch, tmp_path, amx, avx512_bf16, expected):
    _torch_checks(monkeypatch, amx, avx512_bf16)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16\n")  # torch's answer wins
    assert lm.cpu_has_fast_bf16(cpuinfo) is expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True),  # e.g. AMD Zen 4, Intel Cooper Lake
        ("fpu avx512f amx_bf16 amx_tile amx_int8", True),  # Intel Sapphire Rapids
        ("fpu sse2 avx2 avx512f avx512_vnni", False),  # AVX512 without bf16 (Skylake, Cascade Lake)
        ("fpu sse2 avx2", False),
    ],
)
def test_fast_bf16_from_cpuinfo_flags_when_torch_cannot_tell(monkeypatch, tmp_path, flags, expected):
    _torch_checks(monkeypatch, None, None)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert lm.cpu_has_fast_bf16(cpuinfo) is expected
    assert lm.cpu_has_fast_bf16(tmp_path / "missing") is False  # no /proc/cpuinfo (not Linux): float32


def test_no_fast_bf16_without_onednn(monkeypatch):
    # Without oneDNN a bf16 matmul is emulated, far slower than float32, whatever the CPU has.
    _torch_checks(monkeypatch, True, True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert lm.cpu_has_fast_bf16() is False


@pytest.mark.parametrize("fast", [True, False])
def test_resolve_dtype(monkeypatch, fast):
    monkeypatch.setattr(lm, "cpu_has_fast_bf16", lambda: fast)
    cpu_auto = torch.bfloat16 if fast else torch.float32
    assert lm.resolve_dtype(ModelConfig(), "cpu") == cpu_auto
    assert lm.resolve_dtype(ModelConfig(), torch.device("cpu")) == cpu_auto
    assert lm.resolve_dtype(ModelConfig(decoder_training="lora"), "cpu") == cpu_auto
    assert lm.resolve_dtype(ModelConfig(), "cuda") == torch.bfloat16
    assert lm.resolve_dtype(ModelConfig(), "mps") == torch.float32  # elsewhere
    # A decoder whose weights train keeps float32 weights (and AdamW state) under auto.
    assert lm.resolve_dtype(ModelConfig(decoder_training="full"), "cpu") == torch.float32
    assert lm.resolve_dtype(ModelConfig(decoder_training="full"), "cuda") == torch.float32
    # Explicit choices are taken as they are.
    for device in ("cpu", "cuda"):
        assert lm.resolve_dtype(ModelConfig(dtype="float32"), device) == torch.float32
        assert lm.resolve_dtype(ModelConfig(dtype="bfloat16"), device) == torch.bfloat16
        assert lm.resolve_dtype(ModelConfig(dtype="bfloat16", decoder_training="full"), device) == torch.bfloat16


@pytest.mark.parametrize("fast", [True, False])
def test_auto_loads_the_resolved_dtype(monkeypatch, tmp_path, fast):
    tokenizer = tiny_tokenizer()
    tiny_llama(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(lm, "cpu_has_fast_bf16", lambda: fast)
    model, _ = lm.load_model_and_tokenizer(ModelConfig(model=str(tmp_path)))
    assert model.dtype == (torch.bfloat16 if fast else torch.float32)
    model, _ = lm.load_model_and_tokenizer(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert model.dtype == torch.float32


# -- float32 everywhere but the decoder --------------------------------------------------------------------
class DtypeLog:
    """Records the input dtype of every cross-entropy and log-softmax call."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[tuple[str, torch.dtype]] = []
        for name in ("cross_entropy", "log_softmax"):
            original = getattr(F, name)

            def logged(input, *args, _name=name, _original=original, **kwargs):
                self.seen.append((_name, input.dtype))
                return _original(input, *args, **kwargs)

            monkeypatch.setattr(F, name, logged)


@pytest.mark.parametrize("source", ["surprisal", "entropy", "dynamic"])
@pytest.mark.parametrize("training", ["frozen", "lora"])
@pytest.mark.parametrize("latent", ["discrete", "continuous"])
def test_loss_arithmetic_is_float32_with_a_bf16_decoder(monkeypatch, source, training, latent):
    config = build_config(
        dict(
            ALL_TERMS,
            preset="raw",  # the recipe this test was written against (the defaults before issue 23)
            latent=latent,
            decoder_training=training,
            token_weight_source=source,
            zfree_reference_scale=4.0,
            beta=0.1,
            beta_schedule="constant",
            bow_weight=0.5,
            divergence_weight=0.1 if latent == "discrete" else 0.0,
        )
    )
    decoder = tiny_llama(103).to(torch.bfloat16)
    model = build_cvae(config, decoder).train()
    assert next(model.decoder.parameters()).dtype == torch.bfloat16
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values()), {
        n: p.dtype for n, p in trainable.items() if p.dtype != torch.float32
    }
    if training == "lora":
        assert any("lora_" in name for name in trainable)  # the adapters train, in float32

    batch = collate(examples(6), 2, indices=range(6))
    log = DtypeLog(monkeypatch)
    features = model.frozen_pass(batch)
    for name in ("zfree_token_nll", "prior_features", "encoder_features"):
        assert getattr(features, name).dtype == torch.float32, name
    if source == "entropy":
        assert features.zfree_token_entropy.dtype == torch.float32
    out = model(batch, features, step=3)
    assert log.seen and all(dtype == torch.float32 for _, dtype in log.seen), log.seen

    assert out.token_nll.dtype == torch.float32
    for name in ("loss", "reconstruction_total", "kl", "kl_term", "divergence_term"):
        assert getattr(out, name).dtype == torch.float32, name
    assert set(out.reconstruction_terms) == set(TERM_WEIGHT_FIELDS)
    assert all(term.dtype == torch.float32 for term in out.reconstruction_terms.values())
    assert all(value.dtype == torch.float32 for value in out.aux_losses.values())
    w = out.weighting
    for tensor in (w.token_weights, w.inverse_token_weights, w.aligned_base_token_nll, w.example_base_loss):
        assert tensor.dtype == torch.float32
    assert w.token_concentration_factor.dtype == w.inverse_token_base_scale_factor.dtype == torch.float32
    assert torch.isfinite(out.loss)

    optimizer = make_optimizer(model, config)
    out.loss.backward()
    assert any(p.grad is not None for p in trainable.values())
    for name, p in trainable.items():
        assert p.grad is None or p.grad.dtype == torch.float32, name
    assert all(p.grad is None for p in model.decoder.parameters() if not p.requires_grad)
    optimizer.step()
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32


def test_full_decoder_training_keeps_float32_weights_under_auto(monkeypatch):
    monkeypatch.setattr(lm, "cpu_has_fast_bf16", lambda: True)
    config = build_config({"decoder_training": "full"})
    assert lm.resolve_dtype(config.model, "cpu") == torch.float32


def test_mixed_precision_is_bf16_on_cuda_but_for_a_whole_float32_decoder():
    from disentanglement.trainer import mixed_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for training in ("frozen", "lora", "full"):
        for dtype in ("auto", "float32", "bfloat16"):
            assert mixed_precision(cpu, ModelConfig(decoder_training=training, dtype=dtype)) == "no"
    assert mixed_precision(cuda, ModelConfig()) == "bf16"
    assert mixed_precision(cuda, ModelConfig(decoder_training="lora")) == "bf16"
    assert mixed_precision(cuda, ModelConfig(decoder_training="full")) == "no"  # float32 weights: a float32 step
    assert mixed_precision(cuda, ModelConfig(decoder_training="full", dtype="float32")) == "no"
    assert mixed_precision(cuda, ModelConfig(decoder_training="full", dtype="bfloat16")) == "bf16"


def test_dead_codes_restart_in_float32_under_autocast():
    """Under bf16 autocast (CUDA's mixed precision runs the whole forward so) the encoder outputs are bf16; the
    restart candidates are kept in float32, so a dead code restarts in the float32 codebook at one of them."""
    config = build_config(dict(preset="raw", codebook_size=8, dead_code_steps=1, zfree_reference_scale=4.0))
    model = build_cvae(config, tiny_llama(103)).train()
    batch = collate(examples(6), 2, indices=range(6))
    before = model.codebook.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch, model.frozen_pass(batch), step=5)
    assert model._recent_encodings.dtype == torch.float32
    model.post_step(5)  # 8 codes, at most 6 used: the others have been unused for 5 steps and restart
    assert model.codebook.dtype == torch.float32
    moved = (model.codebook != before).any(dim=1)
    assert moved.any()
    for row in model.codebook[moved]:  # each at a recent encoder output, plus 0.01 noise
        assert torch.cdist(row[None], model._recent_encodings).min() < 0.1


def test_bf16_logits_are_scored_in_float32():
    # The head's bf16 logits go through a float32 log-softmax: the NLL equals the float32 computation
    # on the same (bf16-rounded) logits, not a bf16 log-softmax.
    from disentanglement.losses import masked_token_nll_per_position

    torch.manual_seed(0)
    hidden = torch.randn(3, 9, 16).to(torch.bfloat16)
    head = torch.nn.Linear(16, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(8)
    ids = torch.randint(0, 500, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    for chunk in (None, 2):
        nll = masked_token_nll_per_position(hidden, ids, mask, chunk_size=chunk, head=head)
        assert nll.dtype == torch.float32
        logits = head(hidden).float()[:, :-1]
        expected = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(nll, expected, rtol=1e-6, atol=1e-5)


# -- what bf16 does to the seed's quantities ---------------------------------------------------------------
def test_bf16_reference_quantities_are_close_to_float32():
    """b_t, c_base, pi_t, kappa of a bf16 z-free reference against float32 (the same weights, rounded)."""
    decoder = peaked_llama()
    data = examples(48)
    config = build_config({"preset": "raw"})  # the recipe this test was written against (the defaults before issue 23)
    quantities = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_cvae(config, copy.deepcopy(decoder).to(dtype))
        cache = build_feature_cache(model, data, 2, batch_size=8, progress=False)
        tokens, stats = cache.response_weighting(WeightingParams("surprisal", 1.0, 1e-6, 1.0))
        assert tokens.dtype == stats.dtype == torch.float32
        assert all(nll.dtype == torch.float32 for nll in cache.response_nll)
        assert cache.prior_features.dtype == cache.encoder_features.dtype == torch.float32
        quantities[dtype] = {
            "b_t": torch.cat(cache.response_nll),
            "c_base": torch.tensor(estimate_zfree_reference_scale(cache.example_base_losses())),
            "pi_t": tokens[:, 1],
            "kappa": stats[:, _WEIGHTING_STATISTICS.index("token_concentration_factor")],
            "encoder_features": cache.encoder_features,
        }
    f32, bf16 = quantities[torch.float32], quantities[torch.bfloat16]
    assert float(f32["kappa"].mean()) > 1.05  # peaked enough for the weighting to matter

    def relative(name):
        return float(((bf16[name] - f32[name]).abs() / f32[name].abs()).max())

    # Measured on this model: b_t 0.050 nats (1.2 %), c_base 8e-5, pi_t 1.2 %, kappa 0.15 %.
    assert float((bf16["b_t"] - f32["b_t"]).abs().max()) < 0.15
    assert relative("b_t") < 0.04
    assert relative("c_base") < 1e-3
    assert relative("pi_t") < 0.04
    assert relative("kappa") < 0.01
    features = (bf16["encoder_features"] - f32["encoder_features"]).norm(dim=1) / f32["encoder_features"].norm(dim=1)
    assert float(features.max()) < 0.02
    assert not torch.equal(bf16["b_t"], f32["b_t"])  # the bf16 pass really ran in bf16


# -- the feature cache ---------------------------------------------------------------------------------------
def test_cache_key_differs_by_dtype_and_caches_never_mix(tmp_path, monkeypatch):
    import disentanglement.features as features_module

    data = examples(16)
    config = build_config({"preset": "raw"})  # the recipe this test was written against (the defaults before issue 23)
    decoder = peaked_llama()
    model32 = build_cvae(config, copy.deepcopy(decoder))
    model16 = build_cvae(config, copy.deepcopy(decoder).to(torch.bfloat16))
    key32, key16 = feature_fingerprint(model32, data), feature_fingerprint(model16, data)
    assert key32 != key16

    built = []
    original = features_module.build_feature_cache

    def counting(*args, **kwargs):
        built.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(features_module, "build_feature_cache", counting)
    cache32 = load_or_build_feature_cache(model32, data, 2, tmp_path, progress=False)
    cache16 = load_or_build_feature_cache(model16, data, 2, tmp_path, progress=False)  # not the float32 file
    assert built == [model32, model16]
    assert load_feature_cache(tmp_path / "frozen_pass.safetensors", key32) is None  # replaced by the bf16 one
    stored = load_feature_cache(tmp_path / "frozen_pass.safetensors", key16)
    for cache in (cache32, cache16, stored):
        assert all(nll.dtype == torch.float32 for nll in cache.response_nll)
        assert cache.prior_features.dtype == cache.encoder_features.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(stored.response_nll, cache16.response_nll, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(cache32.response_nll, cache16.response_nll, strict=True))
    load_or_build_feature_cache(model16, data, 2, tmp_path, progress=False)
    assert built == [model32, model16]  # the matching bf16 cache is reused


# -- training and checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("training", ["frozen", "lora"])
def test_training_with_a_bf16_decoder_and_loading_its_checkpoint_in_either_dtype(tmp_path, training):
    tokenizer = tiny_tokenizer()
    pairs = make_hidden_factor_pairs([f"tell me about topic {i}" for i in range(40)], kind="clean", seed=0)
    config = trainer_config(tmp_path / "run", decoder_training=training, max_steps=3, save_every=3, eval_every=3)
    decoder = tiny_llama(len(tokenizer)).to(torch.bfloat16)
    result = train(config, (decoder, tokenizer), pairs)
    assert result.checkpoint is not None and result.final_step == 3
    assert all(p.dtype == torch.float32 for p in result.model.parameters() if p.requires_grad)
    assert result.model.zfree_reference_scale > 0
    for name, value in result.last_metrics.items():
        assert value == value, name  # no NaN in the log
    trained = result.model.trainable_state_dict()
    for dtype in (torch.bfloat16, torch.float32):
        model, _, _, _ = load_trained(result.checkpoint, (tiny_llama(len(tokenizer)).to(dtype), tokenizer))
        loaded = model.trainable_state_dict()
        assert set(loaded) == set(trained)
        for name, tensor in loaded.items():
            assert not tensor.is_floating_point() or tensor.dtype == torch.float32, name  # heads, latent, adapters
            torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
        # The frozen decoder is not in the checkpoint: the loaded model keeps the decoder it was given.
        assert next(model.decoder.parameters()).dtype == dtype


def test_the_trainer_gives_accelerate_its_mixed_precision(monkeypatch):
    import accelerate

    from disentanglement import trainer

    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", Recorder)
    monkeypatch.setattr(trainer, "mixed_precision", lambda device, model: f"for {model.decoder_training}")
    trainer._accelerator(torch.device("cpu"), ModelConfig(decoder_training="full"))
    assert seen["mixed_precision"] == "for full" and seen["cpu"] is True
