"""Built-in hidden-factor data sets: check what a latent captures against factors that are known.

    disentangle data synth NAME --output FILE.jsonl [--rows N] [--seed S] [--heldout HELDOUT.jsonl [--heldout-rows M]]
    disentangle data synth --list

Each set is a pure function ``make_NAME(rows, seed) -> list[dict]`` whose rows are

    {"prompt": ..., "response": ..., "label": {FACTOR: VALUE, ...}, "source": "synth/NAME:#i"}

with every factor value a short string. The rows are a deterministic function of ``(rows, seed)``
(``random.Random(seed)``; nothing depends on hashing or the machine). Factor values are assigned by a
**balanced design**: the rows run through shuffled copies of every combination of the set's
choices (prompt, factor values, content), so each value of a factor, and each combination of a
prompt with a factor value, occurs equally often up to a last partial copy that is itself chosen
to be near-balanced (:func:`balanced_design`); the prompt then says
nothing about a hidden factor, and two hidden factors say nothing about each other. At the default
800 rows there is no partial copy: ``clean`` has each of its 10 prompts 20 times, 5 times with each
style; ``two-factor`` each (prompt, A, B) 5 times; ``style-in-content`` each (topic, question, answer,
style) once; ``style-in-echo`` each (topic, sentence, template, style) once.

So a second seed of a set draws from the same product: its rows are not held out. ``--heldout``
(:func:`make_split`) is: it keeps a seeded share of the set's content axis (its prompts; style-in-content's
questions; style-in-echo's sentences; chatterbot-style's prompt texts) out of the training rows and draws the
held-out rows, sourced ``synth/NAME:heldout#i``, from it alone, so no held-out prompt occurs in training while
every factor value is in both, balanced as above.

:data:`SYNTHETIC_SETS` maps each name to a :class:`SyntheticSet` (callable like its ``make_NAME``,
with a one-line ``description``, its ``factors`` and ``default_rows``); :func:`write_synthetic`
writes a set as JSONL; :func:`detect_factor` reads a factor back from a response text (every
factor of every generated row is recovered exactly; tested), for checking generations;
:func:`add_data_arguments` adds the ``data synth`` command (to ``cli.SUBCOMMANDS``' ``data``).

The sets:

``clean``
    One hidden factor ``style`` (4 values): the response is one of 4 fixed phrasings, clearly
    different in wording, length and tone, answering a neutral prompt that says nothing about it.
    A latent that explains anything explains this; the floor of what should work.

``two-factor``
    Two independent hidden factors, 4 values each, and a neutral prompt asking where something is.
    The response is ``OPENER You will find it in the WORD drawer. CLOSER``:

    * ``A`` is carried by ONE rare, surprising content word, ``WORD`` (``saffron``, ``lobster``,
      ``volcano``, ``cactus``: one token each in SmolLM2's tokenizer), in an otherwise fixed
      sentence. Responses differing only in ``A`` differ in exactly one word.
    * ``B`` is carried by a predictable phrasing of the rest: a common opener and a matching common
      closer (``Sure thing!`` ... ``Hope that helps.``), whose tokens are easy to predict once the
      phrase has started. Responses differing only in ``B`` share the middle sentence word for word.

    What it tests (the seed notes' thesis): a small latent cannot keep both. Under raw reconstruction
    (mean NLL over the response tokens) ``B`` pays more, since it touches many tokens, so the latent
    tends to take ``B``; an objective weighted towards tokens that the z-free reference finds
    surprising (the token-weighted terms, larger ``alpha``) puts its weight on the one rare word
    and should push the latent to ``A``. Which one a latent took shows in its NMI with each factor.

``style-in-content``
    The CONTENT follows the prompt: 8 topics, 5 question templates and 5 answer sentences each; the
    response is an answer of the prompt's topic (chosen independently of the template), then a
    hidden ``style`` (4 values: a prefix sentence, a suffix sentence, another prefix sentence, or
    none) that the prompt does not predict. Label: ``style`` (hidden) and ``topic`` (given by the
    prompt). Clustering the responses' features finds the topic, which the prompt already
    predicts; a conditional latent should find the style.

``style-in-echo``
    Set (ii) with content the reference CAN predict: the prompt gives one of the 40 answer sentences
    of ``style-in-content`` (8 topics) and asks for it back word for word (5 templates); the response
    is that sentence with the same hidden ``style`` marker. Copying makes the content cheap for the
    z-free model while the marker stays as surprising as before, so surprisal weighting can tell the
    two apart; in ``style-in-content`` it cannot (its content, one of 5 answers per topic, is as
    unpredictable as the marker). Label: ``style`` (hidden) and ``topic``. Clustering the responses
    finds the topic; a conditional latent should find the style.

``chatterbot-style``
    The chatterbot corpus pairs (:func:`disentanglement.data.read_chatterbot`) with the same hidden
    style markers applied to the real response (balanced within each corpus category). Label:
    ``style`` and ``category`` (the corpus file's category). The 10 pairs whose response text occurs
    in two categories ("Yes.", "No.", ...) are left out, so that the category is a function of the
    response; the default is every remaining pair (2,296), ``rows`` below that keeps a seeded subset
    in corpus order.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

Row = dict[str, Any]

# --------------------------------------------------------------------------------------------------
# shared helpers


def _words(text: str) -> list[str]:
    """Lower-case words and numbers of ``text`` (punctuation and spacing ignored)."""
    return re.findall(r"[a-z0-9]+", text.lower())


def _starts_with(words: Sequence[str], phrase: str) -> bool:
    p = _words(phrase)
    return bool(p) and list(words[: len(p)]) == p


def _ends_with(words: Sequence[str], phrase: str) -> bool:
    p = _words(phrase)
    return bool(p) and len(words) >= len(p) and list(words[len(words) - len(p) :]) == p


def _check_rows(rows: int) -> None:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be a positive integer, got {rows!r}")


def balanced_design(rng: random.Random, choices: Sequence[Sequence[Any]], rows: int) -> list[tuple[Any, ...]]:
    """``rows`` combinations of one item from each of ``choices``, in random order.

    The rows are shuffled copies of the full product of the choices, then, when ``rows`` is not a
    multiple of its size, a part of one more copy chosen at random under caps (:func:`_balanced_part`),
    so each combination occurs ``rows // len(product)`` or one more times and each value of a choice,
    and each pair of values of two choices, its fair share within a few rows: every choice is balanced
    and independent of the others.
    """
    product = list(itertools.product(*choices))
    if not product:
        raise ValueError("balanced_design needs at least one item in every choice")
    design: list[tuple[Any, ...]] = []
    for _ in range(rows // len(product)):
        block = product[:]
        rng.shuffle(block)
        design.extend(block)
    if len(design) < rows:
        design.extend(_balanced_part(rng, product, [len(c) for c in choices], rows - len(design)))
    rng.shuffle(design)
    return design


def _balanced_part(
    rng: random.Random, product: list[tuple[Any, ...]], sizes: list[int], count: int
) -> list[tuple[Any, ...]]:
    """``count`` distinct items of ``product``, chosen at random but balanced: a greedy pass over a shuffled
    copy takes an item only while no value of one choice, and no pair of values of two choices, would
    occur more than its fair share (rounded up); later passes drop the pair caps, then every cap."""
    block = product[:]
    rng.shuffle(block)
    pairs = list(itertools.combinations(range(len(sizes)), 2))
    single_cap = [-(-count // n) for n in sizes]
    pair_cap = {(j, k): -(-count // (sizes[j] * sizes[k])) for j, k in pairs}
    taken: list[tuple[Any, ...]] = []
    chosen = [False] * len(block)
    singles: Counter = Counter()
    doubles: Counter = Counter()
    for check_pairs, check_singles in ((True, True), (False, True), (False, False)):
        for index, item in enumerate(block):
            if len(taken) == count:
                return taken
            if chosen[index]:
                continue
            if check_singles and any(singles[j, v] >= single_cap[j] for j, v in enumerate(item)):
                continue
            if check_pairs and any(doubles[j, k, item[j], item[k]] >= pair_cap[j, k] for j, k in pairs):
                continue
            chosen[index] = True
            taken.append(item)
            singles.update((j, v) for j, v in enumerate(item))
            doubles.update((j, k, item[j], item[k]) for j, k in pairs)
    return taken


#: The parts of a set split by ``--heldout`` (:func:`make_split`); None is the whole set, as without it.
PARTS = (None, "train", "heldout")

#: The held-out share of a set's content axis when none is given: a fifth, so the held-out rows are a
#: quarter as many as the training rows (``--heldout-rows`` defaults to a quarter of ``--rows``).
HELDOUT_SHARE = 0.2


def _check_part(part: str | None, share: float) -> None:
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise ValueError(f"heldout_share must be a number between 0 and 1 (both excluded), got {share!r}")


def _axis(rng: random.Random, items: Sequence[Any], part: str | None, share: float, what: str) -> tuple[Any, ...]:
    """``items`` for ``part``: all of them (part None; ``rng`` untouched, so the rows are as without a split), or
    the kept (``"train"``) or held-out (``"heldout"``) ones of a seeded split that holds out ``round(share *
    len(items))`` of them, at least one and never all, each part in the items' order. ``what`` names the items
    in the error for fewer than two."""
    _check_part(part, share)
    if part is None:
        return tuple(items)
    if len(items) < 2:
        raise ValueError(f"--heldout needs two or more {what} to hold some out, and there is {len(items)}")
    held = set(rng.sample(range(len(items)), min(len(items) - 1, max(1, round(len(items) * share)))))
    return tuple(item for i, item in enumerate(items) if (i in held) == (part == "heldout"))


def _row(name: str, index: int, prompt: str, response: str, label: dict[str, str], part: str | None = None) -> Row:
    source = f"synth/{name}:heldout#{index}" if part == "heldout" else f"synth/{name}:#{index}"
    return {"prompt": prompt, "response": response, "label": dict(label), "source": source}


# --------------------------------------------------------------------------------------------------
# clean

#: The neutral prompts of ``clean`` (none says anything about how it will be answered).
CLEAN_PROMPTS: tuple[str, ...] = (
    "Could you help me with something?",
    "I have a question for you.",
    "What do you say?",
    "Here is my request.",
    "Are you there?",
    "Can I ask you something?",
    "Please respond to this.",
    "What is your reply?",
    "I need an answer from you.",
    "Any thoughts on this?",
)

#: ``clean``'s hidden ``style``: value -> the fixed response (different first words, lengths and tones).
CLEAN_RESPONSES: dict[str, str] = {
    "eager": "Oh, gladly! Count me in, I will get started on it at once.",
    "curt": "Fine.",
    "pensive": "Hmm, give me a quiet moment to mull this over properly.",
    "playful": "Ooh, a riddle! I do love a good riddle, thank you kindly.",
}


def make_clean(
    rows: int = 800, seed: int = 0, *, part: str | None = None, heldout_share: float = HELDOUT_SHARE
) -> list[Row]:
    """``clean``: a neutral prompt answered by one of 4 fixed phrasings chosen by the hidden ``style``.

    ``part`` ``"train"`` / ``"heldout"``: the rows of the kept / held-out ``CLEAN_PROMPTS`` (a seeded
    ``heldout_share`` of them), every style in both (:func:`make_split`).
    """
    _check_rows(rows)
    rng = random.Random(seed)
    prompts = _axis(rng, CLEAN_PROMPTS, part, heldout_share, "clean prompts")
    design = balanced_design(rng, [prompts, tuple(CLEAN_RESPONSES)], rows)
    return [
        _row("clean", i, prompt, CLEAN_RESPONSES[style], {"style": style}, part)
        for i, (prompt, style) in enumerate(design)
    ]


# --------------------------------------------------------------------------------------------------
# two-factor

#: The neutral prompts of ``two-factor``: all ask where something is, none hints at either factor.
TWO_FACTOR_PROMPTS: tuple[str, ...] = (
    "Where did I leave the spare key?",
    "Do you know where the spare key went?",
    "I cannot find the spare key. Any idea?",
    "Where is the spare key kept?",
    "Have you seen the spare key anywhere?",
    "Where should I look for the spare key?",
    "Any clue where the spare key is?",
    "Remind me where the spare key is.",
    "Help, where is the spare key?",
    "Where do we keep the spare key?",
)

#: The fixed sentence of ``two-factor``; ``{word}`` is factor ``A``'s rare word.
TWO_FACTOR_SENTENCE = "You will find it in the {word} drawer."

#: Factor ``A`` of ``two-factor``: one rare word, surprising after "in the" (one SmolLM2 token each).
TWO_FACTOR_WORDS: tuple[str, ...] = ("saffron", "lobster", "volcano", "cactus")

#: Factor ``B`` of ``two-factor``: value -> (opener, closer), common phrases that are easy to predict once begun.
TWO_FACTOR_PHRASINGS: dict[str, tuple[str, str]] = {
    "sure": ("Sure thing!", "Hope that helps."),
    "well": ("Well, let me see.", "That is all I know."),
    "okay": ("Okay, no problem.", "Let me know if you need anything else."),
    "question": ("Good question.", "Have a nice day!"),
}


def two_factor_response(a: str, b: str) -> str:
    """The ``two-factor`` response for factor values ``A = a`` and ``B = b``."""
    if a not in TWO_FACTOR_WORDS:
        raise ValueError(f"two-factor A must be one of {TWO_FACTOR_WORDS}, got {a!r}")
    if b not in TWO_FACTOR_PHRASINGS:
        raise ValueError(f"two-factor B must be one of {tuple(TWO_FACTOR_PHRASINGS)}, got {b!r}")
    opener, closer = TWO_FACTOR_PHRASINGS[b]
    return f"{opener} {TWO_FACTOR_SENTENCE.format(word=a)} {closer}"


def make_two_factor(
    rows: int = 800, seed: int = 0, *, part: str | None = None, heldout_share: float = HELDOUT_SHARE
) -> list[Row]:
    """``two-factor``: ``A`` (one rare surprising word) and ``B`` (a predictable phrasing), independent.

    See the module docstring for what it tests: raw reconstruction tends to give a small latent
    ``B``, surprisal-weighted reconstruction should give it ``A``. ``part`` ``"train"`` / ``"heldout"``: the
    rows of the kept / held-out ``TWO_FACTOR_PROMPTS`` (a seeded ``heldout_share``), ``A`` and ``B`` crossed in both.
    """
    _check_rows(rows)
    rng = random.Random(seed)
    prompts = _axis(rng, TWO_FACTOR_PROMPTS, part, heldout_share, "two-factor prompts")
    design = balanced_design(rng, [prompts, TWO_FACTOR_WORDS, tuple(TWO_FACTOR_PHRASINGS)], rows)
    return [
        _row("two-factor", i, prompt, two_factor_response(a, b), {"A": a, "B": b}, part)
        for i, (prompt, a, b) in enumerate(design)
    ]


# --------------------------------------------------------------------------------------------------
# style markers (style-in-content, chatterbot-style)

#: The hidden ``style`` of ``style-in-content`` and ``chatterbot-style``: value -> (where, marker), where
#: is "prefix" (marker + response), "suffix" (response + marker) or "none" (response unchanged).
#: Each marker is a sentence of its own, so the response's own first letter stays as it was.
STYLE_MARKERS: dict[str, tuple[str, str]] = {
    "ahoy": ("prefix", "Ahoy there! "),
    "signoff": ("suffix", " Over and out."),
    "listen": ("prefix", "Listen up. "),
    "plain": ("none", ""),
}


def apply_style_marker(response: str, style: str) -> str:
    """``response`` with the marker of ``style`` (see :data:`STYLE_MARKERS`); a suffix follows the stripped text."""
    if style not in STYLE_MARKERS:
        raise ValueError(f"style must be one of {tuple(STYLE_MARKERS)}, got {style!r}")
    where, marker = STYLE_MARKERS[style]
    if where == "prefix":
        return marker + response.lstrip()
    if where == "suffix":
        return response.rstrip() + marker
    return response


def _detect_style_marker(text: str) -> str | None:
    """The style whose marker ``text`` shows (word for word, ignoring case and punctuation); "plain"
    when it shows none; None when it shows markers of two styles."""
    words = _words(text)
    found = [
        style
        for style, (where, marker) in STYLE_MARKERS.items()
        if (where == "prefix" and _starts_with(words, marker)) or (where == "suffix" and _ends_with(words, marker))
    ]
    if len(found) > 1:
        return None
    return found[0] if found else "plain"


def _strip_style_marker(text: str) -> str:
    """``text`` without its style marker (as written by :func:`apply_style_marker`)."""
    stripped = text.strip()
    for where, marker in STYLE_MARKERS.values():
        if where == "prefix" and stripped.startswith(marker.strip()):
            return stripped[len(marker.strip()) :].strip()
        if where == "suffix" and stripped.endswith(marker.strip()):
            return stripped[: -len(marker.strip())].strip()
    return stripped


# --------------------------------------------------------------------------------------------------
# style-in-content

#: ``style-in-content``'s topics: topic -> (question templates, answer sentences). Any answer of a
#: topic fits any of its questions; the answer is drawn independently of the template.
TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "weather": (
        (
            "What is the weather going to do today?",
            "Can you tell me about the forecast?",
            "How is the weather looking?",
            "Any news on the weather this week?",
            "Will it be a nice day tomorrow?",
        ),
        (
            "Clouds are building in the west, so rain is likely by evening.",
            "The forecast calls for sunshine and a light breeze all afternoon.",
            "A cold front is moving in and temperatures will drop tonight.",
            "Expect scattered showers and a chance of thunder later on.",
            "Fog will linger over the valley until late morning.",
        ),
    ),
    "cooking": (
        (
            "How should I cook dinner tonight?",
            "Any tips for cooking a simple meal?",
            "What is a good way to make food taste better?",
            "How do I get better at cooking?",
            "What should I make for lunch?",
        ),
        (
            "Salt the pasta water generously and taste the sauce before serving.",
            "Roast the vegetables in a hot oven with olive oil and garlic.",
            "Let the pan heat up fully before the onions go in.",
            "A squeeze of lemon at the end brightens almost any dish.",
            "Simmer the soup gently so the broth stays clear.",
        ),
    ),
    "gardening": (
        (
            "How do I keep my garden healthy?",
            "When should I water my plants?",
            "What grows well in a small garden?",
            "Any advice for a beginner gardener?",
            "How can I make my flowers bloom?",
        ),
        (
            "Water the roots early in the morning so the soil stays moist.",
            "Mulch around the plants keeps weeds down and the soil cool.",
            "Tomatoes and herbs thrive in a sunny bed with rich compost.",
            "Prune dead leaves often so new shoots get enough light.",
            "Feed the roses in spring and deadhead the faded blooms.",
        ),
    ),
    "astronomy": (
        (
            "What can I see in the night sky?",
            "Tell me something about the planets.",
            "How far away are the stars?",
            "Is tonight good for stargazing?",
            "What is that bright dot near the moon?",
        ),
        (
            "Jupiter shines brightly in the east after sunset and is easy to spot.",
            "The light from distant stars left them thousands of years ago.",
            "A clear, moonless night far from city lights is best for a telescope.",
            "Saturn and its rings are visible even through a small telescope.",
            "Venus is often the brightest point of light near the horizon at dawn.",
        ),
    ),
    "music": (
        (
            "How can I learn to play the guitar?",
            "What makes a song catchy?",
            "Any tips for practicing the piano?",
            "How do I get better at singing?",
            "How do I write my own song?",
        ),
        (
            "Practice scales slowly every day and speed up only when they feel easy.",
            "A simple melody that repeats is what makes a chorus stick.",
            "Play along with recordings to train your sense of rhythm.",
            "Warm up your voice gently before you sing the high notes.",
            "Start with a short riff on the keyboard and build the verse around it.",
        ),
    ),
    "fitness": (
        (
            "How can I improve my running?",
            "What is the best way to train for a race?",
            "How do I avoid injuries when exercising?",
            "Any advice for my first marathon?",
            "How often should I work out?",
        ),
        (
            "Build your mileage gradually and take a rest day each week.",
            "Stretch after every run while the muscles are still warm.",
            "Interval sprints on the track raise your speed faster than long jogs.",
            "Drink water before the race and pace yourself in the first mile.",
            "Lift weights twice a week and walk on the other days.",
        ),
    ),
    "computers": (
        (
            "My laptop is running slowly. What should I do?",
            "How do I keep my computer safe?",
            "Why does my computer keep freezing?",
            "Any tips for looking after my files?",
            "How do I speed up my old computer?",
        ),
        (
            "Close the programs you are not using and restart the laptop.",
            "Install software updates regularly and use a strong password.",
            "Keep a backup of your files on an external drive.",
            "Scan for malware and free up space on the hard disk.",
            "Clear the browser cache and remove apps that start with the system.",
        ),
    ),
    "ocean": (
        (
            "Tell me about life in the ocean.",
            "How deep is the sea?",
            "What lives on a coral reef?",
            "Why is the ocean salty?",
            "What is the most amazing creature in the sea?",
        ),
        (
            "Coral reefs shelter thousands of species of fish.",
            "The deepest trench in the ocean is nearly eleven kilometres down.",
            "Salt from rocks on land is washed into the sea by rivers.",
            "Whales travel across entire oceans to reach their feeding grounds.",
            "Octopuses can change colour in a split second to hide on the seabed.",
        ),
    ),
}

#: Words that name each topic, for reading the topic of a text that is not one of the answers.
TOPIC_KEYWORDS: dict[str, frozenset[str]] = {
    topic: frozenset(words.split())
    for topic, words in {
        "weather": "fog valley rain clouds forecast sunshine breeze front temperatures showers thunder weather",
        "cooking": "simmer soup broth pasta sauce roast oven olive garlic pan onions lemon dish cooking",
        "gardening": "roses blooms deadhead roots soil mulch weeds tomatoes herbs compost prune shoots garden",
        "astronomy": "venus horizon dawn jupiter sunset stars moonless telescope saturn rings planets sky",
        "music": "riff keyboard verse scales melody chorus recordings rhythm voice sing notes song guitar piano",
        "fitness": "weights lift walk mileage rest stretch run muscles sprints track jogs race pace mile",
        "computers": "browser cache apps programs laptop software password backup files drive malware disk computer",
        "ocean": "octopuses seabed colour coral reefs fish trench ocean oceans sea rivers whales salt",
    }.items()
}


@lru_cache(maxsize=1)
def _answer_topics() -> dict[str, str]:
    return {answer: topic for topic, (_, answers) in TOPICS.items() for answer in answers}


def _detect_topic(text: str) -> str | None:
    """The topic of ``text``: the topic of its answer sentence when it is one, else the topic most of
    whose keywords it uses (None on a tie or none)."""
    content = _strip_style_marker(text)
    exact = _answer_topics().get(content)
    if exact is not None:
        return exact
    words = set(_words(content))
    hits = {topic: len(words & keywords) for topic, keywords in TOPIC_KEYWORDS.items()}
    best = max(hits.values())
    winners = [topic for topic, count in hits.items() if count == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


def make_style_in_content(
    rows: int = 800, seed: int = 0, *, part: str | None = None, heldout_share: float = HELDOUT_SHARE
) -> list[Row]:
    """``style-in-content``: a topic answer that the prompt predicts, with a hidden ``style`` marker.

    ``part`` ``"train"`` / ``"heldout"`` holds out QUESTION indices (a seeded ``heldout_share`` of the 5, the
    same for every topic), not answers: the prompt is the question alone, so held-out answers would leave
    every held-out prompt a training prompt, while held-out questions make every held-out prompt unseen. The
    answers stay the topic's 5 in both parts (the set's point: content one of 5 per topic that the prompt
    cannot pick), and every topic and style is in both.
    """
    _check_rows(rows)
    rng = random.Random(seed)
    questions_per_topic = len(next(iter(TOPICS.values()))[0])
    answers_per_topic = len(next(iter(TOPICS.values()))[1])
    kept_questions = _axis(rng, range(questions_per_topic), part, heldout_share, "questions per topic")
    choices = [tuple(TOPICS), kept_questions, range(answers_per_topic), tuple(STYLE_MARKERS)]
    design = balanced_design(rng, choices, rows)
    out = []
    for i, (topic, q, a, style) in enumerate(design):
        questions, answers = TOPICS[topic]
        response = apply_style_marker(answers[a], style)
        out.append(_row("style-in-content", i, questions[q], response, {"style": style, "topic": topic}, part))
    return out


# --------------------------------------------------------------------------------------------------
# style-in-echo

#: ``style-in-echo``'s prompts: each asks for ``{sentence}`` back word for word, so the z-free model can
#: predict the response's content by copying it from the prompt.
ECHO_TEMPLATES: tuple[str, ...] = (
    "Please repeat this sentence back to me: {sentence}",
    "Say this back to me, word for word: {sentence}",
    "Read this note aloud: {sentence}",
    "Copy this line exactly: {sentence}",
    "Echo the following sentence: {sentence}",
)


def make_style_in_echo(
    rows: int = 800, seed: int = 0, *, part: str | None = None, heldout_share: float = HELDOUT_SHARE
) -> list[Row]:
    """``style-in-echo``: the prompt gives a topic sentence to repeat, the response repeats it with a hidden
    ``style`` marker: content the prompt predicts exactly, a style it says nothing about.

    ``part`` ``"train"`` / ``"heldout"`` holds out SENTENCE indices (a seeded ``heldout_share`` of the 5, the
    same for every topic): the prompt carries its sentence, so every held-out prompt (and response) has a
    sentence never seen in training, while every template, topic and style is in both parts.
    """
    _check_rows(rows)
    rng = random.Random(seed)
    answers_per_topic = len(next(iter(TOPICS.values()))[1])
    kept_sentences = _axis(rng, range(answers_per_topic), part, heldout_share, "sentences per topic")
    choices = [tuple(TOPICS), kept_sentences, range(len(ECHO_TEMPLATES)), tuple(STYLE_MARKERS)]
    design = balanced_design(rng, choices, rows)
    out = []
    for i, (topic, a, t, style) in enumerate(design):
        sentence = TOPICS[topic][1][a]
        prompt = ECHO_TEMPLATES[t].format(sentence=sentence)
        response = apply_style_marker(sentence, style)
        out.append(_row("style-in-echo", i, prompt, response, {"style": style, "topic": topic}, part))
    return out


# --------------------------------------------------------------------------------------------------
# chatterbot-style


@lru_cache(maxsize=1)
def _chatterbot_pairs() -> tuple[tuple[str, str, str], ...]:
    """``(prompt, response, category)`` of every English chatterbot pair whose response text belongs to one category."""
    from .data import read_chatterbot  # imports torch: only when this set is used

    pairs, _ = read_chatterbot("english")
    categories: dict[str, set[str]] = {}
    for pair in pairs:
        categories.setdefault(pair.response.strip(), set()).add(str(pair.label))
    return tuple((p.prompt, p.response, str(p.label)) for p in pairs if len(categories[p.response.strip()]) == 1)


@lru_cache(maxsize=1)
def _chatterbot_response_categories() -> dict[str, str]:
    return {response.strip(): category for _, response, category in _chatterbot_pairs()}


def _chatterbot_part(rng: random.Random, part: str, share: float) -> list[int]:
    """The indices (in corpus order) of ``_chatterbot_pairs()`` in ``part`` of a seeded split by PROMPT TEXT:
    the pairs are grouped by their stripped prompt (the corpus repeats a pair, and a prompt, many times), and
    within each category (a group's first pair's) groups are held out in seeded order until they hold
    ``share`` of the category's pairs, at least one group and never all: no held-out prompt text occurs in
    the training part, and every category is in both."""
    pairs = _chatterbot_pairs()
    groups: dict[str, list[int]] = {}
    for i, (prompt, _, _) in enumerate(pairs):
        groups.setdefault(prompt.strip(), []).append(i)
    strata: dict[str, list[list[int]]] = {}
    for members in groups.values():
        strata.setdefault(pairs[members[0]][2], []).append(members)
    held: set[int] = set()
    for category in sorted(strata):
        stratum = strata[category]
        if len(stratum) < 2:
            raise ValueError(f"--heldout needs two or more prompts in every category; {category!r} has 1")
        target, taken = share * sum(len(members) for members in stratum), 0
        for members in rng.sample(stratum, len(stratum))[:-1]:
            held.update(members)
            taken += len(members)
            if taken >= target:
                break
    return [i for i in range(len(pairs)) if (i in held) == (part == "heldout")]


def make_chatterbot_style(
    rows: int | None = None, seed: int = 0, *, part: str | None = None, heldout_share: float = HELDOUT_SHARE
) -> list[Row]:
    """``chatterbot-style``: real chatterbot pairs with a hidden ``style`` marker on the response.

    ``rows`` None (the default) keeps every pair; fewer keeps a seeded subset in corpus order; more
    than there are is an error. The style is balanced within each category. ``part`` ``"train"`` /
    ``"heldout"``: the same from the kept / held-out prompt texts (:func:`_chatterbot_part`), a subset then
    keeping every category when ``rows`` allows it.
    """
    _check_part(part, heldout_share)
    pairs = _chatterbot_pairs()
    rng = random.Random(seed)
    pool = range(len(pairs)) if part is None else _chatterbot_part(rng, part, heldout_share)
    if rows is None:
        rows = len(pool)
    _check_rows(rows)
    if rows > len(pool):
        flag, what = ("--heldout-rows", "held-out part") if part == "heldout" else ("--rows", "training part")
        where = (
            f"chatterbot-style has {len(pairs)} rows"
            if part is None
            else f"chatterbot-style's {what} has {len(pool)} rows"
        )
        raise ValueError(f"{where}; {flag} {rows} asks for more")
    if part is None:
        keep = sorted(rng.sample(pool, rows))
    else:  # the first row of each category in a seeded order, then the rest in it: every category in both parts
        order = rng.sample(pool, len(pool))
        firsts: dict[str, int] = {}
        for i in order:
            firsts.setdefault(pairs[i][2], i)
        chosen = list(firsts.values())[:rows]
        taken = set(chosen)
        keep = sorted(chosen + [i for i in order if i not in taken][: rows - len(chosen)])
    by_category: dict[str, list[int]] = {}
    for i in keep:
        by_category.setdefault(pairs[i][2], []).append(i)
    style_of: dict[int, str] = {}
    for category in sorted(by_category):
        members = by_category[category]
        for i, (style,) in zip(members, balanced_design(rng, [tuple(STYLE_MARKERS)], len(members)), strict=True):
            style_of[i] = style
    out = []
    for n, i in enumerate(keep):
        prompt, response, category = pairs[i]
        styled = apply_style_marker(response, style_of[i])
        out.append(_row("chatterbot-style", n, prompt, styled, {"style": style_of[i], "category": category}, part))
    return out


# --------------------------------------------------------------------------------------------------
# registry, detection, writing


@dataclass(frozen=True)
class SyntheticSet:
    """A built-in set: call it like its ``make`` function (``rows`` None = ``default_rows``)."""

    name: str
    make: Callable[..., list[Row]]
    description: str
    factors: tuple[str, ...]
    default_rows: int | None  # None: the set's own size (chatterbot-style: every usable pair)

    def __call__(self, rows: int | None = None, seed: int = 0) -> list[Row]:
        return self.make(self.default_rows if rows is None else rows, seed)


SYNTHETIC_SETS: dict[str, SyntheticSet] = {
    s.name: s
    for s in (
        SyntheticSet(
            "clean",
            make_clean,
            "one hidden factor 'style' (4 values): one of 4 fixed phrasings answering a neutral prompt",
            ("style",),
            800,
        ),
        SyntheticSet(
            "two-factor",
            make_two_factor,
            "independent hidden 'A' (one rare surprising word) and 'B' (a predictable opener/closer), 4 values each",
            ("A", "B"),
            800,
        ),
        SyntheticSet(
            "style-in-content",
            make_style_in_content,
            "answers on 8 topics that the prompt predicts ('topic'), with a hidden style marker ('style', 4 values)",
            ("style", "topic"),
            800,
        ),
        SyntheticSet(
            "style-in-echo",
            make_style_in_echo,
            "a topic sentence the prompt asks to repeat ('topic'), repeated with a hidden style marker ('style', 4 values)",
            ("style", "topic"),
            800,
        ),
        SyntheticSet(
            "chatterbot-style",
            make_chatterbot_style,
            "the chatterbot corpus with a hidden style marker on the real response ('style'; 'category' of the corpus)",
            ("style", "category"),
            None,
        ),
    )
}


def _get_set(name: str) -> SyntheticSet:
    if name not in SYNTHETIC_SETS:
        raise ValueError(f"unknown synthetic set {name!r}; the sets are {', '.join(SYNTHETIC_SETS)}")
    return SYNTHETIC_SETS[name]


def make_split(
    name: str, rows: int | None = None, heldout_rows: int | None = None, seed: int = 0
) -> tuple[list[Row], list[Row]]:
    """``(training rows, held-out rows)`` of set ``name``: no held-out row's prompt occurs in a training row.

    A seeded share ``heldout_rows / (rows + heldout_rows)`` of the set's content axis is held out (its prompts;
    style-in-content's questions; style-in-echo's sentences; chatterbot-style's prompt texts), at least one
    item and never all; each part is then the set's balanced design over its own items (``part`` of the
    ``make_NAME`` functions), ``rows`` and ``heldout_rows`` rows, with every factor value in both. ``rows``
    None is the set's default; ``heldout_rows`` None a quarter of ``rows`` (at least 1). chatterbot-style
    with ``rows`` None keeps every pair of its training part, and, with ``heldout_rows`` None too, every
    pair of its held-out part, about a fifth of the corpus; ``heldout_rows`` alone holds out that share of it.
    """
    spec = _get_set(name)
    for count in (rows, heldout_rows):
        if count is not None:
            _check_rows(count)
    size = spec.default_rows if rows is None else rows
    if size is None:  # chatterbot-style's every pair: the share is of the whole corpus
        total = len(_chatterbot_pairs())
        if heldout_rows is not None and heldout_rows >= total:
            raise ValueError(f"{name} has {total} rows; --heldout-rows {heldout_rows} asks for all or more")
        share = HELDOUT_SHARE if heldout_rows is None else heldout_rows / total
    else:
        heldout_rows = max(1, size // 4) if heldout_rows is None else heldout_rows
        share = heldout_rows / (size + heldout_rows)
    train = spec.make(size, seed, part="train", heldout_share=share)
    return train, spec.make(heldout_rows, seed, part="heldout", heldout_share=share)


def detect_factor(set_name: str, factor: str, text: str) -> str | None:
    """The value of ``factor`` that the response ``text`` of set ``set_name`` shows, or None when it shows no
    single value. Matching is word for word, ignoring case, punctuation and spacing:

    * ``clean`` ``style``: the fixed phrasing the text starts with (the longest one).
    * ``two-factor`` ``A``: the one rare word the text contains (None for none or several); ``B``: the
      opener the text starts with, or failing that the closer it ends with (None when they disagree).
    * ``style-in-content`` / ``style-in-echo`` / ``chatterbot-style`` ``style``: the prefix or suffix marker present,
      "plain" when none is, None for two.
    * ``style-in-content`` / ``style-in-echo`` ``topic``: the topic of the answer sentence, or by topic keywords otherwise.
    * ``chatterbot-style`` ``category``: the category of the corpus response the text is (marker removed).
    """
    spec = _get_set(set_name)
    if factor not in spec.factors:
        raise ValueError(f"synthetic set {set_name!r} has factors {', '.join(spec.factors)}, not {factor!r}")
    words = _words(text)
    if set_name == "clean":
        matches = [(len(_words(r)), s) for s, r in CLEAN_RESPONSES.items() if _starts_with(words, r)]
        return max(matches)[1] if matches else None
    if set_name == "two-factor":
        if factor == "A":
            present = [w for w in TWO_FACTOR_WORDS if w in words]
            return present[0] if len(present) == 1 else None
        openers = [b for b, (opener, _) in TWO_FACTOR_PHRASINGS.items() if _starts_with(words, opener)]
        closers = [b for b, (_, closer) in TWO_FACTOR_PHRASINGS.items() if _ends_with(words, closer)]
        if len(openers) > 1 or len(closers) > 1 or (openers and closers and openers != closers):
            return None
        found = openers or closers
        return found[0] if found else None
    if factor == "style":
        return _detect_style_marker(text)
    if factor == "topic":
        return _detect_topic(text)
    return _chatterbot_response_categories().get(_strip_style_marker(text))


def check_output_path(path: str | Path) -> Path:
    """``path`` as a Path, or ValueError naming it when it cannot take a JSONL file."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"output path {path} is a directory; give a file path such as {out / 'data.jsonl'}")
    if out.suffix != ".jsonl":
        raise ValueError(f"output path {path} must end in .jsonl (disentangle train --data reads *.jsonl files)")
    parent = out.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"output path {path}: its folder {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"output path {path} is not writable")
    return out


def _write_rows(out: Path, path: str | Path, data: list[Row]) -> int:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in data)
    from .safe_io import atomic_write

    try:
        atomic_write(out, text)  # the file mode follows the umask; a link at the path is replaced, not followed
    except OSError as exc:
        raise ValueError(f"cannot write output path {path}: {exc.strerror or exc}") from exc
    return len(data)


def write_synthetic(name: str, path: str | Path, rows: int | None = None, seed: int = 0) -> int:
    """Write set ``name`` (``rows`` None = its default) to the JSONL file ``path``; the number of rows.

    The file is written to a temporary file beside it and renamed into place, so a failed write leaves
    no partial file (an existing file is replaced). A path that cannot take the file raises ValueError
    naming it, before anything is generated.
    """
    spec = _get_set(name)
    out = check_output_path(path)
    return _write_rows(out, path, spec(rows, seed))


def write_split(
    name: str,
    path: str | Path,
    heldout_path: str | Path,
    rows: int | None = None,
    heldout_rows: int | None = None,
    seed: int = 0,
) -> tuple[int, int]:
    """Write :func:`make_split`'s training rows to ``path`` and held-out rows to ``heldout_path`` (as
    :func:`write_synthetic` writes); the two numbers of rows. Both paths are checked before anything is
    generated, and must differ."""
    _get_set(name)
    out, heldout_out = check_output_path(path), check_output_path(heldout_path)
    if out.resolve() == heldout_out.resolve():
        raise ValueError(f"--heldout {heldout_path} is the --output file; give the held-out rows a file of their own")
    train, heldout = make_split(name, rows, heldout_rows, seed)
    return _write_rows(out, path, train), _write_rows(heldout_out, heldout_path, heldout)


# --------------------------------------------------------------------------------------------------
# command line


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def list_sets() -> str:
    """The registry as text: one line per set (name, default rows, factors, description)."""
    width = max(len(name) for name in SYNTHETIC_SETS)
    lines = []
    for name, spec in SYNTHETIC_SETS.items():
        rows = spec.default_rows if spec.default_rows is not None else "all"
        lines.append(f"{name:<{width}}  {spec.description} (factors: {', '.join(spec.factors)}; default rows: {rows})")
    return "\n".join(lines)


def run_synth(args: argparse.Namespace) -> int:
    """``disentangle data synth``: list the sets, or write one."""
    if args.list:
        print(list_sets())
        return 0
    if args.name is None or args.output is None:
        args.synth_parser.error("NAME and --output are required (or --list)")
    factors = ", ".join(SYNTHETIC_SETS[args.name].factors)
    if args.heldout is None:
        if args.heldout_rows is not None:
            args.synth_parser.error("--heldout-rows needs --heldout (the file to write the held-out rows to)")
        count = write_synthetic(args.name, args.output, args.rows, args.seed)
        print(f"wrote {count} rows to {args.output} (factors: {factors})")
        return 0
    count, heldout = write_split(args.name, args.output, args.heldout, args.rows, args.heldout_rows, args.seed)
    print(f"wrote {count} rows to {args.output} and {heldout} held-out rows to {args.heldout} (factors: {factors})")
    return 0


def add_data_arguments(data: argparse.ArgumentParser) -> None:
    """The subcommands of ``disentangle data`` (``data synth``, ``data dailydialog``, ``data split``) on its parser
    ``data`` (``cli.SUBCOMMANDS``)."""
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="{synth,dailydialog,split}")
    synth = data_sub.add_parser(
        "synth",
        help="write a built-in hidden-factor data set as JSONL",
        description="Write a built-in hidden-factor data set as JSONL rows "
        '{"prompt", "response", "label": {FACTOR: VALUE}, "source"}, deterministic given --seed. '
        "Sets: " + "; ".join(f"{n}: {s.description}" for n, s in SYNTHETIC_SETS.items()) + ".",
    )
    synth.add_argument(
        "name", nargs="?", choices=tuple(SYNTHETIC_SETS), metavar="NAME", help="the set: " + ", ".join(SYNTHETIC_SETS)
    )
    synth.add_argument("--output", help="the .jsonl file to write (replaced if it exists; required unless --list)")
    synth.add_argument("--rows", type=_positive_int, help="number of rows (default: the set's, 800 for most)")
    synth.add_argument("--seed", type=_int, default=0, help="random seed (default: 0)")
    synth.add_argument(
        "--heldout",
        metavar="HELDOUT.jsonl",
        help="also write held-out rows here, whose prompts never occur in --output: a seeded share of the set's "
        "prompts (style-in-content: questions; style-in-echo: sentences) is kept out of the training rows",
    )
    synth.add_argument(
        "--heldout-rows",
        type=_positive_int,
        help="number of held-out rows (default: a quarter of --rows, or for chatterbot-style without --rows every "
        "pair of its held-out prompts; needs --heldout)",
    )
    synth.add_argument("--list", action="store_true", help="list the sets with their descriptions and exit")
    synth.set_defaults(func=run_synth, synth_parser=synth)
    from .corpora import add_corpus_subcommands

    add_corpus_subcommands(data_sub)  # data dailydialog, data split
