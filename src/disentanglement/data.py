"""Prompt/response data: loading, tokenisation, split and batching (the built-in synthetic sets are in synthetic.py).

The pipeline is ``load_pairs`` (JSONL file or the built-in chatterbot corpus) ->
``tokenize_pairs`` (chat template, truncation) -> ``split_train_validation`` -> ``collate``.
Every data error names where the offending item came from (file and line, or corpus file and
conversation) so that it can be fixed at its source; an example without response tokens is
rejected here, never discovered later as a NaN (docs/design.md section 2).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import yaml

from disentanglement.config import DataConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DataError(ValueError):
    """Input data that is not what was expected (the message names where it came from)."""


#: A label: one string (integers are stored as their string), an object of named factors, or none.
Label = str | dict[str, str] | None

#: The factor name of a plain string label (see :func:`label_factors`).
SINGLE_FACTOR = "label"


@dataclass(frozen=True)
class PromptResponse:
    """One prompt/response pair; ``source`` says where it came from (``path:line`` or corpus file and index).

    ``label`` is a string, an object of named factors (``{"style": "polite", "topic": "billing"}``,
    values strings) or None.
    """

    prompt: str
    response: str
    label: Label
    source: str


def label_factors(label: Label) -> dict[str, str] | None:
    """The named factors of a label: ``{"label": value}`` for a string label, the object itself for
    an object of factors, None for no label."""
    if label is None:
        return None
    if isinstance(label, dict):
        return label
    return {SINGLE_FACTOR: str(label)}


def label_factor_names(items: Sequence[Any]) -> tuple[str, ...] | None:
    """The factor names shared by every labelled item (anything with ``label`` and ``source``), in the
    first labelled item's order; None when no item has a label.

    Items without a label are allowed (they are left out of label agreement). A :class:`DataError`
    names the first item whose factor names differ from those of the first labelled item.
    """
    names: tuple[str, ...] | None = None
    first = ""
    for item in items:
        factors = label_factors(item.label)
        if factors is None:
            continue
        if names is None:
            names, first = tuple(factors), item.source
        elif set(factors) != set(names):
            raise DataError(
                f"{item.source}: label factors {sorted(factors)} differ from {sorted(names)} of the first labelled "
                f"example ({first}); every labelled example of a data set needs the same factor names (a string "
                f"label is the single factor {SINGLE_FACTOR!r})"
            )
    return names


def _parse_label(label: Any, label_key: str) -> tuple[Label, str | None]:
    """``(label, None)`` for a valid JSONL label value (integers become strings), else ``(None, problem)``."""
    if label is None:
        return None, None
    if isinstance(label, dict):
        if not label:
            return None, f"key {label_key!r} is an empty object; an object of named factors needs at least one factor"
        factors: dict[str, str] = {}
        for name, value in label.items():
            if not name.strip():
                return None, f"key {label_key!r} has a factor with an empty name; factor names must be non-empty"
            if isinstance(value, bool) or not isinstance(value, str | int):
                return None, (
                    f"key {label_key!r} factor {name!r} must be a string or an integer, got {type(value).__name__}"
                )
            factors[name] = str(value)
        return factors, None
    if isinstance(label, bool) or not isinstance(label, str | int):
        return None, (
            f"key {label_key!r} must be a string, an integer or null (or an object of named factors with string "
            f"or integer values), got {type(label).__name__}"
        )
    return str(label), None


# --------------------------------------------------------------------------------------------------
# JSONL


def _surrogate_problem(value: str, what: str) -> str | None:
    """A problem naming a lone surrogate escape (``"\\ud800"``: half a UTF-16 pair, which JSON accepts but
    which is not text a tokenizer can read) in the string ``value``, else None."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"{what} holds a lone surrogate escape \\u{ord(value[exc.start]):04x} at character {exc.start + 1} "
            "(half of a UTF-16 pair, not a character); write the whole pair or the character itself"
        )
    return None


def _label_surrogate_problem(label: Any, label_key: str) -> str | None:
    """:func:`_surrogate_problem` for a label's strings (its value, or its factors' names and values)."""
    if not isinstance(label, dict):
        return _surrogate_problem(label, f"key {label_key!r}") if isinstance(label, str) else None
    for name, value in label.items():
        problem = _surrogate_problem(name, f"key {label_key!r} factor name") or (
            _surrogate_problem(value, f"key {label_key!r} factor {name!r}") if isinstance(value, str) else None
        )
        if problem:
            return problem
    return None


def _label_kinds(label: Any, label_key: str) -> dict[str, tuple[str, str]]:
    """``{factor: (text, "an integer" | "a string")}`` of a valid raw label (a plain label is the factor
    ``label_key``), to find an integer and a string that would read as the same label."""
    if label is None:
        return {}
    items = label.items() if isinstance(label, dict) else [(label_key, label)]
    return {name: (str(value), "an integer" if isinstance(value, int) else "a string") for name, value in items}


def _mixed_label_problem(
    label: Any, label_key: str, lineno: int, seen: dict[tuple[str, str], tuple[str, int]]
) -> str | None:
    """Integer ``1`` and string ``"1"`` would be the same label (labels are compared as text): refused,
    naming the line where the other kind came first. ``seen`` records each (factor, text)'s kind."""
    for name, (text, kind) in _label_kinds(label, label_key).items():
        first = seen.setdefault((name, text), (kind, lineno))
        if first[0] != kind:
            where = f"key {label_key!r}" if name == label_key and not isinstance(label, dict) else f"factor {name!r}"
            return (
                f"{where} is {text if kind == 'an integer' else repr(text)} ({kind}) but line {first[1]} gives "
                f"{text if first[0] == 'an integer' else repr(text)} ({first[0]}); labels are compared as text, so "
                "the two would merge: write every value of this label one way (all strings or all integers)"
            )
    return None


def _format_line_numbers(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (every number is covered)."""
    parts: list[str] = []
    start = prev = None
    for n in numbers:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = n
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def _unique_keys(duplicates: list[str]):
    """An ``object_pairs_hook`` for :func:`json.loads` that records keys given twice in an object."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result and key not in duplicates:
                duplicates.append(key)
            result[key] = value
        return result

    return hook


def _decode_line(raw: bytes, where: str, offset: int) -> tuple[str | None, str | None]:
    """``(text, None)`` for a UTF-8 line, else ``(None, problem)`` naming the byte, its column and file offset."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
        return None, (
            f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}, byte offset "
            f"{offset + exc.start} of the file: {exc.reason}); the file must be UTF-8 text"
        )


def load_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    response_key: str = "response",
    label_key: str = "label",
) -> list[PromptResponse]:
    """Read prompt/response pairs from a JSON-lines file, one object per line.

    Blank lines are skipped. Each other line must be UTF-8 text holding one JSON object, with no key
    given twice, whose ``prompt_key`` and ``response_key`` values are strings; ``label_key`` is
    optional and may be a string, an integer (stored as its string), null, or an object of named
    factors (``{"style": "polite", "topic": "billing"}``: at least one factor, each value a string or
    an integer, stored as its string); every labelled line must name the same factors
    (:func:`label_factor_names`; a string label is the single factor ``"label"``). Invalid lines are
    reported together, each with the file, the line number and what was expected (:class:`DataError`;
    a byte that is not UTF-8 is located by its column and its byte offset in the file). Responses
    that are empty or whitespace-only are rejected in one error listing all their line numbers.
    Empty prompts are allowed.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; expected a .jsonl file")
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    pairs: list[PromptResponse] = []
    problems: list[str] = []
    invalid_lines: set[int] = set()
    empty_responses: list[int] = []
    seen_labels: dict[tuple[str, str], tuple[str, int]] = {}  # (factor, text) -> (kind, first line)
    offset = 0
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            where = f"{path}:{lineno}"
            line, problem = _decode_line(raw, where, offset)
            offset += len(raw)
            if problem is None and not line.strip():
                continue
            record, problem = (None, problem) if problem is not None else _read_record(line, where)
            found = [problem] if problem is not None else []
            if record is not None:
                values, label, found = _record_fields(
                    record, where, lineno, (prompt_key, response_key, label_key), seen_labels
                )
            if found:
                problems.extend(found)
                invalid_lines.add(lineno)
                continue
            if not values[response_key].strip():
                empty_responses.append(lineno)
                continue
            pairs.append(PromptResponse(values[prompt_key], values[response_key], label, where))
    _check_jsonl_pairs(path, pairs, problems, invalid_lines, empty_responses, response_key)
    return pairs


def _read_record(line: str, where: str) -> tuple[dict | None, str | None]:
    """One line's JSON object, or the problem with it: invalid JSON, a key given twice, not an object."""
    duplicates: list[str] = []
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys(duplicates))
    except json.JSONDecodeError as exc:
        return (
            None,
            f"{where}: invalid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno}); expected one JSON object",
        )
    if duplicates:
        keys = ", ".join(repr(k) for k in duplicates)
        return None, f"{where}: duplicate key{'s' if len(duplicates) > 1 else ''} {keys}"
    if not isinstance(record, dict):
        return None, f"{where}: expected a JSON object, got {type(record).__name__}"
    return record, None


def _record_fields(
    record: dict,
    where: str,
    lineno: int,
    keys: tuple[str, str, str],
    seen_labels: dict[tuple[str, str], tuple[str, int]],
) -> tuple[dict[str, str], Label, list[str]]:
    """A record's prompt and response strings, its label, and every problem with them, in that order
    (``keys``: the prompt, response and label keys; ``seen_labels``: the labels' kinds so far)."""
    prompt_key, response_key, label_key = keys
    problems: list[str] = []
    values: dict[str, str] = {}
    for key in (prompt_key, response_key):
        if key not in record:
            problems.append(f"{where}: missing key {key!r} (expected a string; keys present: {sorted(record)})")
        elif not isinstance(record[key], str):
            problems.append(f"{where}: key {key!r} must be a string, got {type(record[key]).__name__}")
        elif problem := _surrogate_problem(record[key], f"key {key!r}"):
            problems.append(f"{where}: {problem}")
        else:
            values[key] = record[key]
    label, problem = _parse_label(record.get(label_key), label_key)
    if problem is None:
        problem = _label_surrogate_problem(record.get(label_key), label_key)
    if problem is None:
        problem = _mixed_label_problem(record.get(label_key), label_key, lineno, seen_labels)
    if problem is not None:
        problems.append(f"{where}: {problem}")
    return values, label, problems


def _check_jsonl_pairs(
    path: Path,
    pairs: list[PromptResponse],
    problems: list[str],
    invalid_lines: set[int],
    empty_responses: list[int],
    response_key: str,
) -> None:
    """Raise what reading ``path`` found: the invalid lines (the first 20 problems), then the empty
    responses, then no pairs at all; the labels' factors must agree (:func:`label_factor_names`)."""
    if problems:
        shown = problems[:20]
        more = f"\n... and {len(problems) - 20} more problems" if len(problems) > 20 else ""
        raise DataError(f"{len(invalid_lines)} invalid line(s) in {path}:\n" + "\n".join(shown) + more)
    if empty_responses:
        raise DataError(
            f"{path}: {len(empty_responses)} empty or whitespace-only response(s) (key {response_key!r}) on "
            f"line(s) {_format_line_numbers(empty_responses)}; every response needs at least one token"
        )
    if not pairs:
        raise DataError(f"{path} holds no prompt/response pairs")
    label_factor_names(pairs)


# --------------------------------------------------------------------------------------------------
# chatterbot corpus


def chatterbot_corpus_dir(language: str = "english") -> Path:
    """The folder of the installed chatterbot-corpus YAML files for ``language``."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the chatterbot corpus is not installed (pip install chatterbot-corpus)")
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    folder = root / language
    if not folder.is_dir():
        available = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise DataError(f"chatterbot corpus has no language {language!r}; available: {available}")
    return folder


def read_chatterbot(
    language: str = "english", corpus_dir: str | Path | None = None
) -> tuple[list[PromptResponse], dict[str, Any]]:
    """Pairs of consecutive utterances of every chatterbot conversation, and counts.

    A conversation ``[u0, u1, u2, ...]`` yields ``(u0 -> u1), (u1 -> u2), ...``; the label is the file's
    first category (else the file stem); non-string utterances are converted with ``str``. Pairs with
    an empty response are skipped and counted in ``stats["skipped_empty_responses"]``; conversations
    that are not lists are skipped and listed in ``stats["skipped_malformed_conversations"]``.
    ``corpus_dir`` replaces the installed corpus folder (for tests or another corpus in this format).
    """
    folder = Path(corpus_dir) if corpus_dir is not None else chatterbot_corpus_dir(language)
    pairs: list[PromptResponse] = []
    skipped = 0
    malformed: list[str] = []
    per_category: dict[str, int] = {}
    files = sorted(folder.glob("*.yml")) + sorted(folder.glob("*.yaml"))
    for file in files:
        try:
            document = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise DataError(f"chatterbot file {file} is not valid YAML: {exc}") from exc
        if not isinstance(document, dict):
            raise DataError(f"chatterbot file {file}: expected a mapping with 'conversations'")
        categories = document.get("categories") or []
        label = str(categories[0]) if categories else file.stem
        for c_index, conversation in enumerate(document.get("conversations") or []):
            if not isinstance(conversation, list):
                # english/trivia.yml #13 is a bare string (a YAML slip in the corpus): no pairs
                malformed.append(f"{file.name}:#{c_index}")
                continue
            turns = ["" if u is None else str(u) for u in conversation]
            for t_index, (prompt, response) in enumerate(zip(turns, turns[1:], strict=False)):
                if not response.strip():
                    skipped += 1
                    continue
                source = f"chatterbot/{language}/{file.name}:#{c_index}.{t_index}"
                pairs.append(PromptResponse(prompt, response, label, source))
                per_category[label] = per_category.get(label, 0) + 1
    stats = {
        "pairs": len(pairs),
        "files": len(files),
        "categories": per_category,
        "skipped_empty_responses": skipped,
        "skipped_malformed_conversations": malformed,
    }
    if malformed:
        logger.warning("chatterbot/%s: skipped conversations that are not lists of utterances: %s", language, malformed)
    logger.info(
        "chatterbot/%s: %d pairs in %d categories from %d files; skipped %d pairs with an empty response",
        language,
        len(pairs),
        len(per_category),
        len(files),
        skipped,
    )
    if not pairs:
        raise DataError(f"chatterbot corpus {folder} holds no prompt/response pairs")
    return pairs, stats


def load_chatterbot(language: str = "english") -> list[PromptResponse]:
    """The chatterbot corpus as prompt/response pairs (see :func:`read_chatterbot`; counts are logged)."""
    return read_chatterbot(language)[0]


def load_pairs(cfg: DataConfig) -> list[PromptResponse]:
    """The pairs named by ``cfg.data``: ``"chatterbot"`` or a ``.jsonl`` file (read with the config's keys)."""
    if cfg.data == "chatterbot":
        return load_chatterbot()
    path = Path(cfg.data).expanduser()
    if path.is_dir():
        raise DataError(f"data path {cfg.data} is a directory; expected a .jsonl file")
    if cfg.data.endswith(".jsonl"):
        return load_jsonl(path, cfg.prompt_key, cfg.response_key, cfg.label_key)
    if path.exists():
        raise DataError(
            f"data path {cfg.data} does not end in .jsonl; DataConfig.data must be 'chatterbot' or a path to a "
            "JSON-lines file named *.jsonl (one JSON object per line; rename the file if it is one)"
        )
    raise DataError(f"DataConfig.data must be 'chatterbot' or a path to a .jsonl file, got {cfg.data!r}")


def limit_examples(items: Sequence[T], max_examples: int | None, seed: int) -> list[T]:
    """At most ``max_examples`` items, chosen by a seeded shuffle (all items, in order, when None)."""
    if max_examples is None or max_examples >= len(items):
        return list(items)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in sorted(order[:max_examples])]


# --------------------------------------------------------------------------------------------------
# tokenisation


@dataclass
class Example:
    """A tokenised pair: the z-free sequence is ``prompt_ids + response_ids``."""

    prompt_ids: list[int]
    response_ids: list[int]
    label: Label  # a string, an object of named factors, or None (see label_factors)
    source: str


def pair_ids(example: Example) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An example's prompt and response ids: what makes two examples copies of one pair."""
    return tuple(example.prompt_ids), tuple(example.response_ids)


def _uses_template(tokenizer: Any, cfg: DataConfig) -> bool:
    return bool(cfg.chat_template and getattr(tokenizer, "chat_template", None))


def format_pair(pair: PromptResponse, tokenizer: Any, cfg: DataConfig) -> tuple[str, str]:
    """``(prompt_text, response_text)`` as :func:`tokenize_pairs` builds them (see there)."""
    if _uses_template(tokenizer, cfg):
        user = {"role": "user", "content": pair.prompt}
        prompt_text = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": pair.response}], tokenize=False)
        if not full.startswith(prompt_text):
            raise DataError(
                f"{pair.source}: the chat template's rendering of the conversation does not start with its "
                f"rendering of the prompt with the generation prompt, so the response cannot be cut off it "
                f"(prompt text {prompt_text!r}, full text {full!r}); set chat_template: false"
            )
        return prompt_text, full[len(prompt_text) :]
    return pair.prompt + "\n", pair.response


def prompt_text_for_generation(prompt: str, tokenizer: Any, cfg: DataConfig) -> str:
    """The text that precedes a response to ``prompt`` (what generation should be conditioned on)."""
    return format_pair(PromptResponse(prompt, "x", None, "generation"), tokenizer, cfg)[0]


#: How many sources the special-token warning of :func:`tokenize_pairs` names.
SPECIAL_TOKEN_SOURCES_SHOWN = 5


def _warn_special_token_texts(pairs: Sequence[PromptResponse], tokenizer: Any) -> int:
    """Log one WARNING for pairs whose raw text holds the tokenizer's special-token strings; their number."""
    # Every control token, not only the named ones: SmolLM2's <file_sep>, <jupyter_code>, ... are added
    # special tokens that all_special_tokens does not list.
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    named = set(getattr(tokenizer, "all_special_tokens", None) or [])
    controls = named | {token.content for token in added.values() if getattr(token, "special", False)}
    specials = sorted((t for t in controls if t), key=len, reverse=True)
    if not specials:
        return 0
    pattern = re.compile("|".join(re.escape(t) for t in specials))
    found: set[str] = set()
    sources: list[str] = []
    count = 0
    for pair in pairs:
        where = [name for name, text in (("prompt", pair.prompt), ("response", pair.response)) if pattern.search(text)]
        if not where:
            continue
        count += 1
        for name in where:
            found.update(pattern.findall(pair.prompt if name == "prompt" else pair.response))
        if len(sources) < SPECIAL_TOKEN_SOURCES_SHOWN:
            sources.append(f"{pair.source} ({' and '.join(where)})")
    if count:
        logger.warning(
            "%d of %d pairs contain the tokenizer's special-token strings %s in their prompt or response text; "
            "they are kept, and those strings will be tokenised as control tokens, not as literal text "
            "(first: %s%s)",
            count,
            len(pairs),
            sorted(found),
            ", ".join(sources),
            ", ..." if count > len(sources) else "",
        )
    return count


def tokenize_pairs(pairs: Sequence[PromptResponse], tokenizer: Any, cfg: DataConfig) -> tuple[list[Example], dict]:
    """Tokenise pairs into :class:`Example` objects, and statistics (also logged).

    Formatting: when ``cfg.chat_template`` is set and the tokenizer has a chat template, the prompt
    text is the template applied to the user turn with the generation prompt, and the response text is
    the rest of the template applied to the user and assistant turns (so it ends with the end-of-turn
    text, e.g. ``<|im_end|>\\n``, and the model learns to stop). Without a template, the prompt text is
    ``prompt + "\\n"`` and the response ids are the response's tokens followed by ``eos_token_id``.
    Both texts are tokenised separately with ``add_special_tokens=False``.

    Control strings: a prompt or response whose raw text (before the template) contains one of the
    tokenizer's control-token strings (its special added tokens, e.g. ``<|im_end|>``, ``<|im_start|>``
    or SmolLM2's ``<file_sep>``) is kept as it is, but that string is tokenised as the control token, not as
    literal text (``add_special_tokens=False`` only stops BOS/EOS being added), so such data can end
    a turn early or fake a role. One WARNING summarises how many pairs do this, which strings were
    found and the first few sources; ``stats["special_token_texts"]`` is the number of such pairs.

    Truncation: a prompt longer than ``cfg.max_prompt_tokens`` keeps its LAST tokens (those nearest
    the response, including the generation prompt); a response longer than ``cfg.max_response_tokens``
    keeps its FIRST tokens (it then loses its end-of-turn tokens). A response or prompt with zero tokens
    is a :class:`DataError` naming its source.

    Stats: ``examples``, ``truncated_prompts``, ``truncated_responses``, ``mean_prompt_tokens`` and
    ``mean_response_tokens`` (after truncation), ``max_prompt_tokens_before_truncation``,
    ``max_response_tokens_before_truncation``, ``chat_template`` (whether the template was used) and
    ``special_token_texts``.
    """
    use_template = _uses_template(tokenizer, cfg)
    eos = None
    if not use_template:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise DataError(
                "the tokenizer has no chat template (or it is disabled) and no eos_token_id to end responses"
            )
    prompt_texts: list[str] = []
    response_texts: list[str] = []
    for pair in pairs:
        prompt_text, response_text = format_pair(pair, tokenizer, cfg)
        prompt_texts.append(prompt_text)
        response_texts.append(response_text)
    if not pairs:
        return [], {
            "examples": 0,
            "truncated_prompts": 0,
            "truncated_responses": 0,
            "mean_prompt_tokens": 0.0,
            "mean_response_tokens": 0.0,
            "max_prompt_tokens_before_truncation": 0,
            "max_response_tokens_before_truncation": 0,
            "chat_template": use_template,
            "special_token_texts": 0,
        }
    special_token_texts = _warn_special_token_texts(pairs, tokenizer)
    prompt_ids_all = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]
    response_ids_all = tokenizer(response_texts, add_special_tokens=False)["input_ids"]
    examples, counts = _truncated_examples(pairs, prompt_ids_all, response_ids_all, eos, cfg)
    stats = {
        "examples": len(examples),
        "truncated_prompts": counts["truncated_prompts"],
        "truncated_responses": counts["truncated_responses"],
        "mean_prompt_tokens": sum(len(e.prompt_ids) for e in examples) / len(examples),
        "mean_response_tokens": sum(len(e.response_ids) for e in examples) / len(examples),
        "max_prompt_tokens_before_truncation": counts["max_prompt_tokens_before_truncation"],
        "max_response_tokens_before_truncation": counts["max_response_tokens_before_truncation"],
        "chat_template": use_template,
        "special_token_texts": special_token_texts,
    }
    _log_tokenized(stats, cfg)
    return examples, stats


def _truncated_examples(
    pairs: Sequence[PromptResponse],
    prompt_ids_all: Sequence[Sequence[int]],
    response_ids_all: Sequence[Sequence[int]],
    eos: int | None,
    cfg: DataConfig,
) -> tuple[list[Example], dict[str, int]]:
    """The examples of the tokenised pairs (``eos`` appended to each response when given), truncated as
    :func:`tokenize_pairs` says, with the counts of truncations and the longest prompt and response before."""
    examples: list[Example] = []
    truncated_prompts = truncated_responses = 0
    max_prompt_seen = max_response_seen = 0
    for pair, prompt_ids, response_ids in zip(pairs, prompt_ids_all, response_ids_all, strict=True):
        prompt_ids = list(prompt_ids)
        response_ids = list(response_ids)
        if not response_ids:
            raise DataError(f"{pair.source}: the response {pair.response!r} tokenises to zero tokens")
        if eos is not None:
            response_ids.append(eos)
        if not prompt_ids:
            raise DataError(f"{pair.source}: the prompt {pair.prompt!r} tokenises to zero tokens")
        max_prompt_seen = max(max_prompt_seen, len(prompt_ids))
        max_response_seen = max(max_response_seen, len(response_ids))
        if len(prompt_ids) > cfg.max_prompt_tokens:
            prompt_ids = prompt_ids[-cfg.max_prompt_tokens :]
            truncated_prompts += 1
        if len(response_ids) > cfg.max_response_tokens:
            response_ids = response_ids[: cfg.max_response_tokens]
            truncated_responses += 1
        examples.append(Example(prompt_ids, response_ids, pair.label, pair.source))
    counts = {
        "truncated_prompts": truncated_prompts,
        "truncated_responses": truncated_responses,
        "max_prompt_tokens_before_truncation": max_prompt_seen,
        "max_response_tokens_before_truncation": max_response_seen,
    }
    return examples, counts


def _log_tokenized(stats: dict, cfg: DataConfig) -> None:
    logger.info(
        "tokenised %d examples (chat template: %s): mean prompt %.1f tokens, mean response %.1f tokens; "
        "truncated %d prompts (> %d tokens, kept the last) and %d responses (> %d tokens, kept the first)",
        stats["examples"],
        stats["chat_template"],
        stats["mean_prompt_tokens"],
        stats["mean_response_tokens"],
        stats["truncated_prompts"],
        cfg.max_prompt_tokens,
        stats["truncated_responses"],
        cfg.max_response_tokens,
    )


# --------------------------------------------------------------------------------------------------
# split and batching


def _whole_groups(items: Sequence[T], count: int, seed: int, key: Callable[[T], Hashable]) -> set[int]:
    """:func:`split_train_validation`'s validation indices with ``key``: whole groups, each group equally likely
    whatever its size (a ``random.Random(seed)`` permutation of the groups in order of first occurrence), one held
    out where it fits in what is left of the count and holds at most a tenth of it (at least one item)."""
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    members = list(groups.values())
    order = list(range(len(members)))
    random.Random(seed).shuffle(order)
    cap = max(1, count // 10)
    chosen: set[int] = set()
    for g in order:
        if len(chosen) == count:
            break
        if len(members[g]) <= min(cap, count - len(chosen)):
            chosen.update(members[g])
    if not chosen and count:  # no group fits: the first of the permutation that leaves training something
        group = next((members[g] for g in order if len(members[g]) < len(items)), [])
        chosen.update(group)
        if not group:
            logger.warning("no validation set: all %d examples are copies of one pair", len(items))
    return chosen


def split_train_validation(
    items: Sequence[T], validation_fraction: float, seed: int, key: Callable[[T], Hashable] | None = None
) -> tuple[list[T], list[T]]:
    """A deterministic, disjoint, covering split into ``(train, validation)``.

    A ``random.Random(seed)`` permutation picks ``round(len(items) * validation_fraction)`` validation
    items, at least one when the fraction is positive and there are at least two items, and never all
    of them. Both parts keep the items' original order. When the fraction is positive but the split
    holds out nothing (fewer than two items), a WARNING says that there is no validation set and why.

    With ``key``, items of one key (copies of one example) go to the same side, and validation draws the groups,
    not the items, at random: a seeded permutation of the groups is walked and a group goes to validation where
    it fits in what is left of the count and holds at most a tenth of the count, else it stays in training (a
    pair the chatterbot corpus repeats 121 times would otherwise be half of a 231-pair validation split, and a
    walk over the items would hold it out 121 times as often as a pair seen once). Where no two items share a key
    the split is the one without ``key``; where no group fits, the first group of the permutation that is not
    every item is held out whole, larger than asked.
    """
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    n = len(items)
    n_val = round(n * validation_fraction)
    if validation_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    n_val = min(n_val, max(n - 1, 0))
    if validation_fraction > 0 and n_val == 0:
        logger.warning(
            "no validation set: validation_fraction is %s, but there %s only %d example%s and the split never "
            "holds out all of them (a validation example needs at least 2 examples); validation metrics "
            "will not be computed",
            validation_fraction,
            "is" if n == 1 else "are",
            n,
            "" if n == 1 else "s",
        )
    if key is None:
        order = list(range(n))
        random.Random(seed).shuffle(order)
        val_index = set(order[:n_val])
    else:
        val_index = _whole_groups(items, n_val, seed, key)
    train = [item for i, item in enumerate(items) if i not in val_index]
    val = [item for i, item in enumerate(items) if i in val_index]
    return train, val


#: Batches per length-sorted megabatch of a length-grouped order (transformers' ``group_by_length`` uses 50).
MEGABATCH_BATCHES = 50


@dataclass
class DataOrder:
    """Deterministic epoch-wise shuffling whose position is saved with each checkpoint.

    With ``lengths`` and ``batch > 1`` the order is length-grouped (``train.group_by_length``): each
    epoch's permutation is cut into megabatches of :data:`MEGABATCH_BATCHES` batches, each megabatch is
    sorted by length and cut into batches of ``batch`` examples, and the batches are shuffled over the
    epoch. Every example still comes once per epoch; a batch holds examples of similar length, so it
    carries little padding. ``batch`` is what one call of :meth:`next_indices` takes (the batch size
    times the number of processes); a batch that straddles two epochs keeps the batches after it aligned.
    """

    size: int
    seed: int
    epoch: int = 0
    position: int = 0
    lengths: Sequence[int] | None = field(default=None, repr=False)
    batch: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.lengths is not None and len(self.lengths) != self.size:
            raise ValueError(f"DataOrder got {len(self.lengths)} lengths for {self.size} examples")
        self._order = self._permutation(self.epoch)

    @property
    def grouped(self) -> bool:
        return self.lengths is not None and self.batch > 1

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        if not self.grouped:
            return order
        # The calls before this epoch took epoch * size examples: the first `head` finish a batch begun
        # in the previous epoch, so the batches after them start on a multiple of `batch`.
        head = (-(epoch * self.size)) % self.batch
        head = min(head, self.size)
        mega = MEGABATCH_BATCHES * self.batch
        rest = order[head:]
        batches = []
        for start in range(0, len(rest), mega):
            chunk = sorted(rest[start : start + mega], key=lambda i: (self.lengths[i], i))
            batches += [chunk[b : b + self.batch] for b in range(0, len(chunk), self.batch)]
        full = [b for b in batches if len(b) == self.batch]
        partial = [i for b in batches if len(b) < self.batch for i in b]  # at most one, the epoch's last
        shuffled = torch.randperm(len(full), generator=generator).tolist()
        return order[:head] + [i for k in shuffled for i in full[k]] + partial

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position >= self.size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out.extend(self._order[self.position : self.position + take])
            self.position += take
        return out

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps: the epoch and position, and ``batch`` for a length-grouped order."""
        return {"epoch": self.epoch, "position": self.position, **({"batch": self.batch} if self.grouped else {})}


def length_order(examples: Sequence[Example]) -> list[int]:
    """The indices of ``examples`` by prompt plus response length, shortest first (ties in data order): batches taken
    in this order carry little padding, and every command that scores a data set batches it so."""
    return sorted(range(len(examples)), key=lambda i: len(examples[i].prompt_ids) + len(examples[i].response_ids))


def length_groups(lengths: Sequence[int], call_cost: float, max_groups: int = 4) -> list[list[int]]:
    """The rows of a right-padded batch in groups that run at their own width: the split, by sorted length,
    into at most ``max_groups`` groups of consecutive lengths that minimises the positions computed
    (``sum over groups of rows x longest length``) plus ``call_cost`` per group. Rows keep their order
    inside a group; one group (all rows) when splitting saves nothing."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    if n < 2:
        return [order]
    sizes = [lengths[i] for i in order]
    # best[g][k]: the cost of the k shortest rows in g groups; the last group is rows j..k-1 at width sizes[k-1].
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, max_groups + 1):
        for k in range(1, n + 1):
            for j in range(k):
                cost = best[g - 1][j] + (k - j) * sizes[k - 1] + call_cost
                if cost < best[g][k]:
                    best[g][k], cut[g][k] = cost, j
    groups_count = min(range(1, max_groups + 1), key=lambda g: (best[g][n], g))
    bounds, k = [], n
    for g in range(groups_count, 0, -1):
        bounds.append((cut[g][k], k))
        k = cut[g][k]
    return [sorted(order[j:k]) for j, k in reversed(bounds)]


@dataclass
class Batch:
    """Right-padded z-free sequences ``[x][y]``.

    ``target_mask[b, t]`` is 1 where token ``t`` is a response token (0 on prompt and padding);
    the loss on token ``t`` comes from the logits at ``t - 1``, so the shifted mask is
    ``target_mask[:, 1:]``. Masks come from the lengths, never from comparing ids to the pad id.
    """

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    target_mask: torch.Tensor  # [B, T] float
    prompt_lengths: torch.Tensor  # [B] long
    response_lengths: torch.Tensor  # [B] long
    labels: list[Label]
    indices: torch.Tensor  # [B] long
    #: ``[B, T]`` bool or None: in a training step with ``latent.word_dropout``, False where the decoder reads a
    #: zero vector instead of the token's embedding (:meth:`.cvae_base.CVAEBase.conditioned_inputs`); the targets
    #: and the z-free reference keep every token
    decoder_input_keep: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` of the batch (at its width)."""
        return Batch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            target_mask=self.target_mask[start:stop],
            prompt_lengths=self.prompt_lengths[start:stop],
            response_lengths=self.response_lengths[start:stop],
            labels=list(self.labels[start:stop]),
            indices=self.indices[start:stop],
            decoder_input_keep=None if self.decoder_input_keep is None else self.decoder_input_keep[start:stop],
        )

    def take(self, rows: torch.Tensor) -> Batch:
        """The rows at the indices ``rows`` ``[R]``, in that order (at the batch's width)."""
        return Batch(
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            target_mask=self.target_mask[rows],
            prompt_lengths=self.prompt_lengths[rows],
            response_lengths=self.response_lengths[rows],
            labels=[self.labels[i] for i in rows.tolist()],
            indices=self.indices[rows],
            decoder_input_keep=None if self.decoder_input_keep is None else self.decoder_input_keep[rows],
        )

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with its tensors on ``device``."""
        return Batch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            target_mask=self.target_mask.to(device),
            prompt_lengths=self.prompt_lengths.to(device),
            response_lengths=self.response_lengths.to(device),
            labels=list(self.labels),
            indices=self.indices.to(device),
            decoder_input_keep=None if self.decoder_input_keep is None else self.decoder_input_keep.to(device),
        )


def collate(
    examples: Sequence[Example], pad_token_id: int, indices: Sequence[int] | torch.Tensor | None = None
) -> Batch:
    """Batch examples as right-padded ``prompt_ids + response_ids`` (see :class:`Batch`).

    ``indices`` (default ``0..B-1``) are carried through, e.g. dataset positions for cached features.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    prompt_lengths = torch.tensor([len(e.prompt_ids) for e in examples], dtype=torch.long)
    response_lengths = torch.tensor([len(e.response_ids) for e in examples], dtype=torch.long)
    for e in examples:
        if not e.response_ids:
            raise DataError(f"{e.source}: example has no response tokens")
    lengths = prompt_lengths + response_lengths
    batch_size, width = len(examples), int(lengths.max())
    input_ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
    for b, e in enumerate(examples):
        input_ids[b, : lengths[b]] = torch.tensor(e.prompt_ids + e.response_ids, dtype=torch.long)
    positions = torch.arange(width).unsqueeze(0)
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    target_mask = ((positions >= prompt_lengths.unsqueeze(1)) & (positions < lengths.unsqueeze(1))).float()
    if indices is None:
        index_tensor = torch.arange(batch_size, dtype=torch.long)
    else:
        index_tensor = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if index_tensor.numel() != batch_size:
            raise ValueError(f"collate got {index_tensor.numel()} indices for {batch_size} examples")
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        target_mask=target_mask,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        labels=[e.label for e in examples],
        indices=index_tensor,
    )
