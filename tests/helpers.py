"""Shared test utilities: the tiny models of :mod:`disentanglement.testing`, training runs, an HTML checker, plot capture."""

from __future__ import annotations

import contextlib
import json
from html.parser import HTMLParser
from pathlib import Path

from disentanglement.testing import (  # noqa: F401 (re-exported for the tests)
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    UNK,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
)


def flat(config) -> dict:
    """A RunConfig's fields in one dict, by field name."""
    return {k: v for section in config.to_dict().values() for k, v in section.items()}


def recipe(config) -> dict:
    """The recipe a RunConfig trains with: its values of ``config.RECIPE_FIELDS`` (what a preset sets)."""
    from disentanglement.config import RECIPE_FIELDS

    values = flat(config)
    return {name: values[name] for name in RECIPE_FIELDS}


def train_and_read_metrics(output_dir: Path, decoder, tokenizer, pairs, **overrides) -> list[dict]:
    """Train a continuous CVAE briefly on ``pairs`` (terms 1, 3 and 4 weighted, no chat template) and
    return its ``metrics.jsonl`` records; ``overrides`` are config fields."""
    from disentanglement.config import build_config
    from disentanglement.trainer import train

    settings = dict(
        preset="raw",  # the recipe these runs were written against (the defaults before issue 23)
        output_dir=str(output_dir),
        max_steps=4,
        batch_size=4,
        progress=False,
        chat_template=False,
        eval_every=2,
        eval_batches=1,
        token_weighted_weight=1.0,
        normalized_concentration_corrected_token_weighted_weight=1.0,
        latent="continuous",
    )
    settings.update(overrides)
    train(build_config(settings), (decoder, tokenizer), pairs)
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def trainer_config(output_dir, **overrides):
    """The trainer tests' run: 6 steps of 4 examples, checkpoints and validation every 3, terms 1, 3 and 4."""
    from disentanglement.config import build_config

    values = dict(
        preset="raw",  # the recipe these runs were written against (the defaults before issue 23)
        output_dir=str(output_dir),
        max_steps=6,
        batch_size=4,
        save_every=3,
        eval_every=3,
        eval_batches=2,
        warmup_steps=2,
        progress=False,
        token_weighted_weight=0.5,
        normalized_concentration_corrected_token_weighted_weight=0.5,
        chat_template=False,
        validation_fraction=0.2,
    )
    values.update(overrides)
    return build_config(values)


# --------------------------------------------------------------------------- HTML pages

#: Elements without an end tag.
VOID_TAGS = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
)
#: Tags that load something from elsewhere (a self-contained page has none).
LOADING_TAGS = frozenset({"link", "iframe", "frame", "object", "embed", "img", "audio", "video", "source", "track"})


class Element:
    """One parsed element: its tag, its attributes and the text inside it (children's included)."""

    def __init__(self, tag: str, attrs: dict[str, str]):
        self.tag = tag
        self.attrs = attrs
        self.text = ""

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    def __repr__(self) -> str:
        return f"<{self.tag} {self.attrs}>{self.text[:40]!r}"


class HtmlPage(HTMLParser):
    """A page parsed with :mod:`html.parser`: every element in document order, the tags seen, nesting
    errors, the scripts' contents by id; see :func:`check_html`."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self.tags: list[str] = []
        self.errors: list[str] = []
        self.scripts: dict[str, str] = {}
        self._open: list[Element] = []

    @property
    def unclosed(self) -> list[str]:
        return [e.tag for e in self._open]

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v if v is not None else "" for k, v in attrs})
        self.tags.append(tag)
        self.elements.append(element)
        if tag not in VOID_TAGS:
            self._open.append(element)
        if tag == "script":
            self.scripts[element.attrs.get("id", "")] = ""

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.elements.append(Element(tag, {k: v if v is not None else "" for k, v in attrs}))
        if tag not in VOID_TAGS:
            self.errors.append(f"self-closing non-void <{tag}/>")

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if not self._open or self._open[-1].tag != tag:
            self.errors.append(f"unbalanced </{tag}> with open {self.unclosed[-3:]}")
            return
        element = self._open.pop()
        if tag == "script":
            self.scripts[element.attrs.get("id", "")] = element.text

    def handle_data(self, data):
        for element in self._open:
            element.text += data

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Element]:
        """Elements with this tag (any when None), this class among theirs, and these attribute values
        (``data_i="3"`` matches ``data-i="3"``)."""
        wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
        return [
            e
            for e in self.elements
            if (tag is None or e.tag == tag)
            and (cls is None or cls in e.classes)
            and all(e.attrs.get(k) == v for k, v in wanted.items())
        ]

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Element:
        """The one element :meth:`find_all` matches (an assertion error unless exactly one)."""
        found = self.find_all(tag, cls, **attrs)
        assert len(found) == 1, f"{len(found)} elements match {tag} .{cls} {attrs}"
        return found[0]

    def by_id(self, element_id: str) -> Element:
        return self.find(id=element_id)

    @property
    def token_spans(self) -> list[dict[str, str]]:
        """The attributes of every ``<span class="tok">``, in order."""
        return [e.attrs for e in self.find_all("span", "tok")]

    @property
    def token_texts(self) -> list[str]:
        """The text of every ``<span class="tok">``, in order."""
        return [e.text for e in self.find_all("span", "tok")]


def external_resources(page: HtmlPage, text: str) -> list[str]:
    """What in a page would load from elsewhere: loading tags, ``src`` attributes, links that are not
    ``#anchors``, absolute URLs and CSS imports or ``url()``."""
    found = [f"<{e.tag}>" for e in page.elements if e.tag in LOADING_TAGS]
    for e in page.elements:
        if "src" in e.attrs:
            found.append(f"<{e.tag} src={e.attrs['src']!r}>")
        href = e.attrs.get("href")
        if href is not None and not href.startswith("#"):
            found.append(f"<{e.tag} href={href!r}>")
    found += [marker for marker in ("http://", "https://", "@import", "url(") if marker in text]
    return found


def check_html(text: str, self_contained: bool = True) -> HtmlPage:
    """Parse ``text`` and assert an HTML5 page: ``<!DOCTYPE html>`` first, every non-void tag closed in
    order, none left open, and (``self_contained``) nothing loaded from elsewhere. Returns the page,
    whose elements, tags, texts and scripts the caller can inspect further."""
    assert text.startswith("<!DOCTYPE html>"), text[:40]
    page = HtmlPage()
    page.feed(text)
    page.close()
    assert not page.errors, page.errors
    assert not page.unclosed, f"unclosed tags {page.unclosed}"
    if self_contained:
        assert not external_resources(page, text), external_resources(page, text)
    return page


# --------------------------------------------------------------------------- matplotlib figures


@contextlib.contextmanager
def capture_figures():
    """Record every matplotlib figure saved inside the block: yields a dict, file name -> the Figure
    (filled as files are saved; the files are written as usual)."""
    from matplotlib.figure import Figure

    from disentanglement import report

    figures: dict[str, Figure] = {}
    original, original_save = Figure.savefig, report.save_figure

    def savefig(self, fname, *args, **kwargs):
        if isinstance(fname, str | Path):
            figures[Path(fname).name] = self
        return original(self, fname, *args, **kwargs)

    def save_figure(fig, path, **kwargs):  # the package saves into memory, then writes the file safely
        figures[Path(path).name] = fig
        return original_save(fig, path, **kwargs)

    Figure.savefig, report.save_figure = savefig, save_figure
    try:
        yield figures
    finally:
        Figure.savefig, report.save_figure = original, original_save


def visible_axes(figure) -> list:
    """The figure's visible axes (colour bars included), in the order they were added."""
    return [ax for ax in figure.axes if ax.get_visible()]


def line_series(ax) -> list[tuple[list[float], list[float]]]:
    """Every line drawn on ``ax`` as (x values, y values)."""
    return [([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]) for line in ax.get_lines()]


def tick_labels(ax, axis: str = "x") -> list[str]:
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [label.get_text() for label in labels]


class Stop(Exception):
    """Raised by :func:`stop_at`'s callback: a training run interrupted at a chosen step."""


def stop_at(n):
    """A trainer callback that raises :class:`Stop` at step ``n``."""

    def callback(step, record):
        if step == n:
            raise Stop

    return callback


def view_pairs():
    """24 hidden-factor pairs with prompts of 7 lengths: the encoder-view tests' data."""
    from disentanglement.testing import make_hidden_factor_pairs

    return make_hidden_factor_pairs([f"what about item {'y' * (i % 7)} {i}" for i in range(24)], kind="clean")


def tiny_cvae(tokenizer, pairs, seed: int = 0, **overrides):
    """``(model, examples, config)``: a CVAE on a fresh tiny Llama (seeded), its config fields ``overrides``."""
    import torch

    from disentanglement.config import build_config
    from disentanglement.data import tokenize_pairs
    from disentanglement.models import build_cvae

    config = build_config(dict(chat_template=False, **overrides))
    examples, _ = tokenize_pairs(pairs, tokenizer, config.data)
    torch.manual_seed(seed)
    return build_cvae(config, tiny_llama(len(tokenizer))), examples, config


def prompt_batch(tokenizer, n: int = 5, chat_template: bool = True):
    """A collated batch of ``n`` hidden-factor pairs whose prompts grow by a token each (``prompt x.. end``):
    rows of ``n`` lengths, so every batch has padding."""
    from disentanglement.config import build_config
    from disentanglement.data import collate, tokenize_pairs
    from disentanglement.testing import make_hidden_factor_pairs

    pairs = make_hidden_factor_pairs([f"prompt {'x' * i} end" for i in range(n)], kind="clean", seed=1)
    examples, _ = tokenize_pairs(pairs, tokenizer, build_config({"chat_template": chat_template}).data)
    return collate(examples, tokenizer.pad_token_id)
