"""The token colours and the legend of the inspect page and the explorer page agree, read back from a real
headless Chromium (the harness of ``test_explorer.py``): a token is coloured by ``value / max`` from 0
(non-negative quantities) or by ``value / max|value|`` around 0 (signed ones), so the legend's white end is 0
(signed: its blue end is ``-max|value|``), not the data's minimum."""

from __future__ import annotations

from disentanglement.explorer import render_explorer_html
from disentanglement.report import render_token_html
from test_explorer import _page, browser  # noqa: F401  (the Chromium fixture)

WHITE, RED, BLUE = "rgb(255, 255, 255)", "rgb(255, 0, 0)", "rgb(0, 0, 255)"


def fade(share: float) -> int:
    """The green and blue channels (red scale) at ``value / ref = share``, as the pages compute them."""
    return round(255 * (1 - abs(share)))


def read_back(chromium, select: str | None = None) -> dict:
    """Computed background colours of every token and of the legend's two swatches, and the legend's texts."""
    if select is not None:
        chromium.evaluate(
            f"(() => {{ const s = document.getElementById('quantity'); s.value = '{select}';"
            " s.dispatchEvent(new Event('change')); })()"
        )
    return chromium.evaluate(
        "(() => { const bg = e => getComputedStyle(e).backgroundColor;"
        " const text = id => document.getElementById(id).textContent;"
        " return {tokens: Array.from(document.querySelectorAll('span.tok')).map(bg),"
        " lo: bg(document.getElementById('legend-lo-swatch')), hi: bg(document.getElementById('legend-hi-swatch')),"
        " lo_text: text('legend-min'), hi_text: text('legend-max'), range: text('legend-range')}; })()"
    )


def test_inspect_page_legend_agrees_with_the_token_colours(browser, tmp_path):  # noqa: F811
    page = tmp_path / "inspect.html"
    values = {"nll": [2.0, 4.0, 8.0], "gain": [-2.0, 0.0, 1.0]}
    page.write_text(render_token_html(["a", "b", "c"], values, "t", default="nll"))
    browser.open(page.as_uri())
    seen = read_back(browser)
    # non-negative: white is 0 and red the maximum; the minimum 2 is a quarter of the way, not white
    assert seen["tokens"] == [f"rgb(255, {fade(0.25)}, {fade(0.25)})", f"rgb(255, {fade(0.5)}, {fade(0.5)})", RED]
    assert (seen["lo"], seen["lo_text"]) == (WHITE, "0") and (seen["hi"], seen["hi_text"]) == (RED, "8")
    assert seen["tokens"][2] == seen["hi"] and seen["tokens"][0] != seen["lo"]
    assert seen["range"] == "(tokens range 2 to 8)"
    # signed: blue is -max|v| = -2 (the token at -2 has the legend's blue), red +2 (the token at 1 is half way)
    seen = read_back(browser, "gain")
    assert seen["tokens"] == [BLUE, WHITE, f"rgb(255, {fade(0.5)}, {fade(0.5)})"]
    assert (seen["lo"], seen["lo_text"]) == (BLUE, "-2") and (seen["hi"], seen["hi_text"]) == (RED, "2")
    assert seen["tokens"][0] == seen["lo"] and seen["tokens"][2] != seen["hi"]
    # and back: the static page (before any change) and the script draw the same
    assert read_back(browser, "nll")["lo_text"] == "0"
    assert not browser.problems(), browser.problems()


def test_explorer_legend_agrees_with_the_token_colours(browser, tmp_path):  # noqa: F811
    page = tmp_path / "explorer.html"
    page.write_text(render_explorer_html(_page(response="Hello")))  # tokens H, e, l, lo: values 1, 2, 3, 4
    browser.open(page.as_uri())
    seen = read_back(browser)  # z-free surprisal, 1 .. 4
    assert seen["tokens"] == [f"rgb(255, {fade(v / 4)}, {fade(v / 4)})" for v in (1, 2, 3)] + [RED]
    assert (seen["lo"], seen["lo_text"], seen["hi"], seen["hi_text"]) == (WHITE, "0", RED, "4")
    assert seen["tokens"][3] == seen["hi"]
    seen = read_back(browser, "gain")  # -1, 2, 3, 4: signed around 0, blue end at -4
    assert seen["tokens"][0] == f"rgb({fade(0.25)}, {fade(0.25)}, 255)" and seen["tokens"][3] == seen["hi"] == RED
    assert (seen["lo"], seen["lo_text"], seen["hi_text"]) == (BLUE, "-4", "4")
    assert not browser.problems(), browser.problems()
