"""Tiny in-process models for tests and benchmarks: a character-level tokenizer and 2-layer causal LMs
(Llama and GPT-2 shapes), built from a config in seconds, with no files and no downloads; decoders of real
models' published shapes with random weights (:data:`MODEL_SHAPES`, for the benchmarks); and the
hidden-factor pairs the learning tests recover."""

from __future__ import annotations

import random
import re
import string
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.initialization import no_init_weights

from .data import PromptResponse

UNK = "<unk>"
BOS = "<|im_start|>"
EOS = "<|im_end|>"
SPECIAL_TOKENS = (UNK, BOS, EOS)  # ids 0, 1, 2, as in SmolLM2
CHARACTERS = string.printable  # 100 printable ASCII characters, whitespace included

#: ChatML in the SmolLM2 style, without SmolLM2's default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII plus ``<unk>``, ``<|im_start|>``, ``<|im_end|>``.

    103 tokens; bos ``<|im_start|>`` (1), eos = pad = ``<|im_end|>`` (2) like SmolLM2, and a ChatML chat
    template (unless ``chat_template=False``). Decoding concatenates the characters.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=UNK, bos_token=BOS, eos_token=EOS, pad_token=EOS
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build(build, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.eval()


def tiny_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer LlamaForCausalLM (hidden 32, 2 heads, 256 positions), seeded, in eval mode."""
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return _build(lambda: LlamaForCausalLM(LlamaConfig(**settings)), seed)


def tiny_gpt2(vocab_size: int, seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A 2-layer GPT2LMHeadModel (hidden 32, 2 heads, 256 positions), seeded, in eval mode."""
    settings = dict(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    settings.update(overrides)
    return _build(lambda: GPT2LMHeadModel(GPT2Config(**settings)), seed)


# -- real models' shapes, random weights ------------------------------------------------------------------

#: Published shapes (Llama architecture, tied input and output embeddings) of the decoders the benchmarks
#: build with random weights: ``benchmarks/step_cost.py --model config:NAME``. SmolLM2 from its model cards'
#: ``config.json`` (HuggingFaceTB/SmolLM2-*), Llama-3.2-1B from meta-llama's; ``parameters`` is the count
#: of the real model (tied embeddings counted once).
MODEL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        parameters=134_515_008,
    ),
    "smollm2-360m": dict(
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        intermediate_size=2560,
        vocab_size=49152,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        parameters=361_821_120,
    ),
    "smollm2-1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=8192,
        vocab_size=49152,
        rope_theta=130000.0,
        max_position_embeddings=8192,
        parameters=1_711_376_384,
    ),
    "llama-1b": dict(  # Llama-3.2-1B (its rope scaling for long contexts does not change the cost)
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        parameters=1_235_814_400,
    ),
}


def shape_config(name: str, **overrides) -> LlamaConfig:
    """The :class:`LlamaConfig` of ``MODEL_SHAPES[name]`` (tied embeddings, RMSNorm eps 1e-5), with ``overrides``."""
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
    settings = {k: v for k, v in MODEL_SHAPES[name].items() if k != "parameters"}
    settings.update(tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    settings.update(overrides)
    return LlamaConfig(**settings)


def random_llama(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    **overrides,
) -> LlamaForCausalLM:
    """A decoder of ``MODEL_SHAPES[name]``'s shape with random weights, in ``dtype`` on ``device``, in eval mode.

    Built without transformers' initialisation (seconds per billion weights on a CPU), then every weight
    matrix drawn from N(0, 0.02^2) (the config's ``initializer_range``) and every norm weight set to 1,
    directly in ``dtype`` on ``device`` (``"meta"``: shapes only, nothing allocated). ``overrides`` change
    the config (``num_hidden_layers=2`` gives a shrunk variant). Step times do not depend on the values.
    """
    config = shape_config(name, **overrides)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.tie_weights()  # no_init_weights also skips the tying that initialisation does
    if torch.device(device).type != "meta":
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, config.initializer_range, generator=generator)
    return model.eval()


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters' elements (a tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


# -- the tests' hidden-factor data (the built-in sets of `disentangle data synth` are in synthetic.py) --

#: Responses of the "clean" hidden-factor data: factor f answers with phrase f (more are generated past these).
CLEAN_PHRASES: tuple[str, ...] = (
    "Absolutely, I would love to help with that!",
    "No.",
    "Hmm, let me think about it for a while.",
    "Ha ha, that is a funny question!",
    "I am sorry, but I really cannot say.",
    "Yes, yes, yes, a thousand times yes!",
    "Please ask my colleague in the other office.",
    "Once upon a time, there was a question just like this one.",
)

_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

#: Style markers of the "marked" hidden-factor data, one per factor: (kind, text) with kind
#: "prefix" (text + response), "suffix" (response + text) or "none" (response unchanged).
MARKED_STYLES: tuple[tuple[Literal["prefix", "suffix", "none"], str], ...] = (
    ("prefix", "Oh wow, "),
    ("suffix", " (smiles)"),
    ("prefix", "Honestly speaking, "),
    ("none", ""),
)


def clean_phrases(num_factors: int) -> list[str]:
    """The ``num_factors`` distinct "clean" responses: :data:`CLEAN_PHRASES`, then generated ones."""
    if num_factors < 1:
        raise ValueError(f"num_factors must be >= 1, got {num_factors}")
    phrases = list(CLEAN_PHRASES[:num_factors])
    for f in range(len(CLEAN_PHRASES), num_factors):
        spelled = " ".join(_NUMBER_WORDS[int(d)] for d in str(f))
        phrases.append(f"My answer is code {spelled}, and nothing else.")
    return phrases


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def detect_style(text: str, kind: Literal["clean", "marked"] = "clean", num_factors: int = 4) -> int | None:
    """The hidden factor whose style ``text`` shows, or None when no single style is recognised.

    "clean": the factor whose phrase the text starts with, word for word, ignoring case and
    punctuation (the longest matching phrase wins). "marked": the prefix or suffix marker present; a
    text with no marker is the "none" style when that style is among the ``num_factors`` used; a
    text with two different markers is None.
    """
    if kind == "clean":
        words = _words(text)
        best: tuple[int, int] | None = None
        for factor, phrase in enumerate(clean_phrases(num_factors)):
            phrase_words = _words(phrase)
            length = len(phrase_words)
            starts_with_phrase = length > 0 and words[:length] == phrase_words
            if starts_with_phrase and (best is None or length > best[1]):
                best = (factor, length)
        return None if best is None else best[0]
    if kind == "marked":
        styles = _marked_styles(num_factors)
        stripped = text.strip()
        found = set()
        none_factor = None
        for f, (where, marker) in enumerate(styles):
            if where == "none":
                none_factor = f
                continue
            present = stripped.startswith(marker.strip()) if where == "prefix" else stripped.endswith(marker.strip())
            if present:
                found.add(f)
        if len(found) == 1:
            return found.pop()
        if not found:
            return none_factor
        return None
    raise ValueError(f"kind must be 'clean' or 'marked', got {kind!r}")


def _marked_styles(num_factors: int) -> tuple[tuple[str, str], ...]:
    if not 1 <= num_factors <= len(MARKED_STYLES):
        raise ValueError(f"'marked' data supports 1 to {len(MARKED_STYLES)} factors, got {num_factors}")
    return MARKED_STYLES[:num_factors]


def apply_style(response: str, factor: int, num_factors: int = 4) -> str:
    """``response`` with the style marker of ``factor`` (see :data:`MARKED_STYLES`)."""
    where, marker = _marked_styles(num_factors)[factor]
    if where == "prefix":
        return marker + response
    if where == "suffix":
        return response + marker
    return response


def make_hidden_factor_pairs(
    prompts: list[str],
    num_factors: int = 4,
    kind: Literal["clean", "marked"] = "clean",
    seed: int = 0,
    responses: list[str] | None = None,
) -> list[PromptResponse]:
    """Synthetic pairs whose response depends on a hidden factor that the prompt does not reveal.

    Each prompt gets a factor ``f`` drawn uniformly from ``range(num_factors)`` by ``random.Random(seed)``;
    the label is ``str(f)``. "clean": the response is phrase ``f`` of :func:`clean_phrases`.
    "marked": the response is ``responses[i]`` with style marker ``f`` of :data:`MARKED_STYLES`
    (a prefix, a suffix, another prefix, or none). :func:`detect_style` reads the factor back.
    """
    if num_factors < 1:
        raise ValueError(f"num_factors must be >= 1, got {num_factors}")
    rng = random.Random(seed)
    factors = [rng.randrange(num_factors) for _ in prompts]
    pairs: list[PromptResponse] = []
    if kind == "clean":
        phrases = clean_phrases(num_factors)
        for i, (prompt, factor) in enumerate(zip(prompts, factors, strict=True)):
            pairs.append(PromptResponse(prompt, phrases[factor], str(factor), f"hidden-factor/clean:#{i}"))
    elif kind == "marked":
        _marked_styles(num_factors)
        if responses is None or len(responses) != len(prompts):
            raise ValueError("'marked' hidden-factor data needs one response per prompt (responses=...)")
        for i, (prompt, response, factor) in enumerate(zip(prompts, responses, factors, strict=True)):
            styled = apply_style(response, factor, num_factors)
            pairs.append(PromptResponse(prompt, styled, str(factor), f"hidden-factor/marked:#{i}"))
    else:
        raise ValueError(f"kind must be 'clean' or 'marked', got {kind!r}")
    return pairs
