"""Tiny in-process models for tests and benchmarks: a character-level tokenizer and 2-layer causal LMs
(Llama and GPT-2 shapes), built from a config in seconds, with no files and no downloads."""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
