"""``disentangle inspect RUN --explore``: the corpus explorer page (``explorer.py``).

Unit tests of the page's content (escaping, shares, label distributions by hand), then the page of the
trained tiny runs of ``conftest.py`` rendered in a real headless Chromium (Debian's ``chromium`` package),
driven through the Chrome DevTools Protocol over ``--remote-debugging-pipe`` (NUL-separated JSON on file
descriptors 3 and 4: no websocket library, no network port). The browser test saves a screenshot and
prints its path. Without Chromium the test fails and says how to install it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import NUM_FACTORS, model_and_tokenizer
from disentanglement import cli
from disentanglement.config import Scoring
from disentanglement.explorer import (
    cluster_groups,
    discrete_groups,
    label_distribution,
    render_explorer_html,
    run_explore,
)
from disentanglement.inspection import QUANTITIES
from helpers import check_html

PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = (
    "the explorer's browser test needs Chromium and found none of "
    + ", ".join(CHROMIUM_NAMES)
    + " on PATH (nor $CHROMIUM): install it with `apt-get install -y chromium` (Debian/Ubuntu, as root; "
    "`bash scripts/setup.sh` does it when run as root) or point $CHROMIUM at a Chromium or Chrome binary"
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the tiny models run about ten times faster so on a busy 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- a page by hand


def _row(codes, posterior, label, kl=0.1, gain=0.01, prompt="p", response="r"):
    return {
        "source": f"s:{codes}",
        "prompt": prompt,
        "response": response,
        "label": label,
        "codes": codes,
        "posterior": posterior,
        "kl": kl,
        "latent_gain_nats_per_token": gain,
    }


def _page(response: str = "Hello", prompt: str = "Hi", label="a") -> dict:
    """A two-group page with one example, built by hand (the input :func:`render_explorer_html` takes)."""
    tokens = list(response[:3]) + [response[3:]] if len(response) > 3 else list(response)
    n = len(tokens)
    example = {
        "row": 0,
        "source": "file.jsonl:1",
        "prompt": prompt,
        "response": response,
        "label": label,
        "tokens": tokens,
        "values": {q: [float(i + 1) * (-1 if q == "gain" and i == 0 else 1) for i in range(n)] for q in QUANTITIES},
    }
    labels = label_distribution([label])
    group = {
        "title": "slot 0 · code 0",
        "count": 1,
        "share": 1.0,
        "mean_kl": 0.5,
        "mean_latent_gain": 0.1,
        "labels": labels,
        "latent": {"codes": [0]},
        "examples": [{"example": 0, "confidence": 0.9}],
        "generations": [{"prompt": prompt, "text": response}],
    }
    empty = dict(group, id="s0-c1", title="slot 0 · code 1", count=0, share=0.0, examples=[])
    empty["labels"] = label_distribution([])
    return {
        "title": "Corpus explorer",
        "meta": {"data": "by hand"},
        "latent": "discrete",
        "examples_total": 1,
        "quantities": list(QUANTITIES),
        "default": "zfree_surprisal",
        "groups": [dict(group, id="s0-c0"), empty],
        "examples": [example],
        "generation": {"greedy": True, "max_new_tokens": 4, "prompts": [prompt]},
    }


MALICIOUS = '</script><script>alert(1)</script><img src=x onerror="alert(2)"> & <b>bold</b>'


def test_user_text_is_escaped_everywhere():
    text = render_explorer_html(_page(response=MALICIOUS, prompt="<i>prompt</i>", label={"style": "<u>x</u>"}))
    parser = check_html(text)
    assert parser.tags.count("script") == 2  # the page's own data and code
    assert not {"img", "b", "i", "u"} & set(parser.tags)
    assert "<img" not in text and "<b>" not in text and "<i>prompt" not in text and "<u>x" not in text
    assert text.count("</script>") == 2
    assert "".join(parser.token_texts) == MALICIOUS  # the token spans show the response as it is
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in text
    assert "http://" not in text and "https://" not in text


def test_shares_sum_to_one_per_slot_and_every_code_is_a_group():
    rows = [
        _row([0, 2], [[0.9, 0.1, 0.0], [0.1, 0.1, 0.8]], "a"),
        _row([0, 2], [[0.6, 0.4, 0.0], [0.0, 0.1, 0.9]], "a"),
        _row([1, 0], [[0.2, 0.8, 0.0], [0.7, 0.2, 0.1]], "b"),
        _row([0, 0], [[0.7, 0.3, 0.0], [0.5, 0.4, 0.1]], None),
    ]
    groups = discrete_groups(rows, codebook_size=3, count=2)
    assert [(g["slot"], g["code"]) for g in groups] == [(s, k) for s in range(2) for k in range(3)]
    for slot in range(2):
        assert sum(g["share"] for g in groups if g["slot"] == slot) == pytest.approx(1.0)
    by = {(g["slot"], g["code"]): g for g in groups}
    assert by[0, 0]["members"] == [0, 1, 3] and by[0, 0]["share"] == 0.75
    assert by[0, 0]["top"] == [0, 3] and by[0, 0]["confidence"] == [0.9, 0.7]  # most confident first
    assert by[0, 2]["members"] == [] and by[0, 2]["top"] == []  # an unused code is still a group
    # generated under: the code in its slot, the members' most common code (smallest on ties) elsewhere
    assert by[0, 0]["codes"] == [0, 2] and by[1, 2]["codes"] == [0, 2] and by[1, 0]["codes"] == [0, 0]
    assert by[0, 2]["codes"] == [2, 0]  # empty: the data's most common code in the other slot


def test_code_zero_in_another_slot_is_a_code_not_none():
    """A group whose members take code 0 in the other slot is generated under 0 there, even when the data's
    most common code in that slot is another one (``0 or default`` read it as "none")."""
    rows = [
        _row([0, 0], [[0.9, 0.1], [0.8, 0.2]], "a"),
        _row([1, 1], [[0.1, 0.9], [0.2, 0.8]], "b"),
        _row([1, 1], [[0.2, 0.8], [0.1, 0.9]], "b"),
    ]
    by = {(g["slot"], g["code"]): g for g in discrete_groups(rows, codebook_size=2, count=1)}
    assert by[0, 0]["codes"] == [0, 0] and by[1, 0]["codes"] == [0, 0]  # overall most common is 1 in both slots
    assert by[0, 1]["codes"] == [1, 1]


def test_label_distribution_by_hand():
    labels = [{"style": "polite", "topic": "x"}, {"style": "rude", "topic": "x"}, {"style": "polite", "topic": "y"}]
    dist = label_distribution(labels + [None])
    assert dist["examples"] == 4 and dist["labelled"] == 3
    assert dist["factors"]["style"] == [
        {"value": "polite", "count": 2, "share": pytest.approx(2 / 3)},
        {"value": "rude", "count": 1, "share": pytest.approx(1 / 3)},
    ]
    assert dist["factors"]["topic"] == [
        {"value": "x", "count": 2, "share": pytest.approx(2 / 3)},
        {"value": "y", "count": 1, "share": pytest.approx(1 / 3)},
    ]
    plain = label_distribution(["b", "a", "b", 3])
    assert [(v["value"], v["count"]) for v in plain["factors"]["label"]] == [("b", 2), ("3", 1), ("a", 1)]
    assert label_distribution([None, None]) == {"examples": 2, "labelled": 0, "factors": {}}


def test_clusters_of_posterior_means():
    mu = [[0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [5.0, 5.0], [5.2, 5.0]]
    groups = cluster_groups(mu, 2, count=2, seed=0)
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    assert sorted(sorted(g["members"]) for g in groups) == [[0, 1, 2], [3, 4]]
    small = next(g for g in groups if 0 in g["members"])
    assert small["centroid"] == pytest.approx([1 / 30, 0.2 / 3])
    assert small["top"] == [0, 1]  # the nearest to the centroid first
    assert all(c <= 0 for c in small["confidence"]) and small["confidence"] == sorted(small["confidence"], reverse=True)


# --------------------------------------------------------------------------- the page of a trained run


@pytest.fixture(scope="module")
def discrete_page(discrete_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("explore") / "explorer.html"
    path = run_explore(
        discrete_run.checkpoint,
        output=out,
        examples_per_group=2,
        num_prompts=2,
        max_new_tokens=6,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    assert path == out
    return path


def test_page_content_of_a_discrete_run(discrete_page):
    text = discrete_page.read_text()
    parser = check_html(text)
    assert text.startswith("<!DOCTYPE html>") and "http://" not in text and "https://" not in text
    assert "<link" not in text and " src=" not in text  # nothing loaded from anywhere
    for code in range(NUM_FACTORS):
        assert f'data-group="s0-c{code}"' in text
    shares = [float(s.split('"')[0]) for s in text.split('data-share="')[1:]]
    assert len(shares) == NUM_FACTORS and sum(shares) == pytest.approx(1.0, abs=1e-5)
    assert text.count('class="gen generation"') == 2 * NUM_FACTORS
    assert parser.tags.count("script") == 2
    groups = parser.find_all("section", "group")
    assert [g.attrs["data-group"] for g in groups] == [f"s0-c{code}" for code in range(NUM_FACTORS)]
    assert [float(g.attrs["data-share"]) for g in groups] == shares
    assert len(parser.find_all("td", "generation")) == 2 * NUM_FACTORS


def test_continuous_page(continuous_run, tmp_path):
    path = run_explore(
        continuous_run.run_dir,
        output=tmp_path / "c.html",
        clusters=3,
        examples_per_group=1,
        prompts=["red cat 1"],
        max_new_tokens=4,
        scoring=Scoring(prior_samples=4),
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    text = path.read_text()
    parser = check_html(text)
    assert all(f'data-group="k{k}"' in text for k in range(3)) and 'data-group="k3"' not in text
    assert [g.attrs["data-group"] for g in parser.find_all("section", "group")] == ["k0", "k1", "k2"]
    prompts = [td.text for td in parser.find_all("td", "gen") if "generation" not in td.classes]
    assert prompts == ["red cat 1"] * 3  # one prompt, generated under each cluster's latent
    assert text.count('class="gen generation"') == 3 and "red cat 1" in text


def test_factor_labels_are_distributed_per_factor(discrete_run, tmp_path):
    rows = [json.loads(line) for line in discrete_run.data_path.read_text().splitlines()][:12]
    data = tmp_path / "factors.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": r["prompt"], "response": r["response"], "label": {"factor": r["label"], "half": i % 2}}
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    path = run_explore(
        discrete_run.checkpoint,
        data=str(data),
        examples_per_group=1,
        num_prompts=0,
        progress=False,
        model_and_tokenizer=model_and_tokenizer(),
    )
    assert path == discrete_run.run_dir / "inspect" / "explorer.html"  # the default place
    text = path.read_text()
    parser = check_html(text)
    assert text.count('data-factor="factor"') == text.count('data-factor="half"') > 0
    tables = parser.find_all("table", "labels")
    assert [t.attrs["data-factor"] for t in tables] == ["factor", "half"] * (len(tables) // 2)
    assert "generated under this latent" not in text and "no prompts" in text
    # each group's label counts add up to its examples, per factor
    for section in text.split('<section class="group')[1:]:
        count = int(section.split("share ")[1].split("(")[1].split(" of")[0])
        for factor in ("factor", "half"):
            if count:
                table = section.split(f'data-factor="{factor}"')[1].split("</table>")[0]
                cells = [c.split("</td>")[0] for c in table.split("<td>")[1:]]
                assert sum(int(n) for n in cells[1::3]) == count


def test_cli_explore(discrete_run, tmp_path, injected_loader, capsys):
    page = tmp_path / "page.html"
    argv = ["inspect", str(discrete_run.checkpoint), "--explore", "--output", str(page), "--no-progress"]
    assert cli.main(argv + ["--explore-tokens", "3", "--explore-prompts", "1", "--explore-examples", "1"]) == 0
    assert f"explorer: {page}" in capsys.readouterr().out and page.is_file()
    assert len(check_html(page.read_text()).find_all("section", "group")) == NUM_FACTORS
    assert cli.main(argv + ["--explore-tokens", "0"]) == 2
    assert "--explore-tokens" in capsys.readouterr().err
    assert cli.main(["inspect", str(discrete_run.checkpoint), "--output", str(page)]) == 2
    assert "--explore" in capsys.readouterr().err


# --------------------------------------------------------------------------- in a real browser


def find_chromium() -> str:
    """The Chromium binary ($CHROMIUM or on PATH); fails the test (never skips) when there is none."""
    candidate = os.environ.get("CHROMIUM")
    if candidate and (shutil.which(candidate) or Path(candidate).is_file()):
        return shutil.which(candidate) or candidate
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(INSTALL_HINT)


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``)."""

    def __init__(self, binary: str, profile: Path, timeout: float = 60.0):
        self.timeout = timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_pipes():  # the child reads commands on fd 3 and writes replies on fd 4 (dup2: inheritable)
            a, b = os.dup(to_child_r), os.dup(from_child_w)  # not 3 or 4, and closed at exec
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--window-size=1200,900",
            "about:blank",
        ]
        self.log = profile.parent / "chromium-stderr.log"
        profile.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as log:
            # close_fds=False: the fds made after preexec_fn must survive; Python's own fds are close-on-exec
            self.process = subprocess.Popen(
                args, preexec_fn=wire_pipes, close_fds=False, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply from Chromium over the DevTools pipe")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    err = self.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"Chromium closed the DevTools pipe (exit {self.process.poll()}): {err}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, *, session: bool = True) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        while True:
            event = self._read_message(deadline)
            if event.get("method") == method:
                return event
            self.events.append(event)

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        )
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        self.send("Runtime.evaluate", {"expression": "0"})  # flush events queued before now
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails']}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        return found

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.send("Browser.close", session=False)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_child, self._from_child):
            os.close(fd)


@pytest.fixture
def browser(tmp_path):
    binary = find_chromium()
    started = Browser(binary, tmp_path / "chromium-profile")
    try:
        yield started
    finally:
        started.close()


COLOURS = "Array.from(document.querySelectorAll('span.tok')).map(s => s.style.backgroundColor)"


def test_page_in_headless_chromium(discrete_page, browser, tmp_path):
    start = time.perf_counter()
    browser.open(discrete_page.resolve().as_uri())
    assert browser.evaluate("document.readyState") == "complete"
    groups = browser.evaluate("Array.from(document.querySelectorAll('section.group')).map(s => s.dataset.group)")
    assert groups == [f"s0-c{k}" for k in range(NUM_FACTORS)]  # every code, once, in order
    visible = browser.evaluate(
        "Array.from(document.querySelectorAll('section.group')).every(s => s.getBoundingClientRect().height > 0)"
    )
    assert visible
    options = browser.evaluate("Array.from(document.getElementById('quantity').options).map(o => o.value)")
    assert {"zfree_surprisal", "token_weight", "gain"} <= set(options)
    assert browser.evaluate("document.querySelectorAll('span.tok').length") > 0
    before = browser.evaluate(COLOURS)
    assert browser.evaluate("document.getElementById('quantity').value") == "zfree_surprisal"
    assert all(c.startswith("rgb(") for c in before)

    def choose(quantity):
        browser.evaluate(
            f"(() => {{ const s = document.getElementById('quantity'); s.value = '{quantity}';"
            " s.dispatchEvent(new Event('change')); })()"
        )
        assert browser.evaluate("document.body.dataset.quantity") == quantity
        return browser.evaluate(COLOURS)

    for quantity in ("token_weight", "gain"):
        assert choose(quantity) != before, f"switching the colouring to {quantity} changed no token's colour"
    assert choose("zfree_surprisal") == before  # and back
    shot = browser.screenshot(tmp_path / "explorer.png")
    assert not browser.problems(), browser.problems()
    data = shot.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    print(f"\nexplorer screenshot: {shot} ({len(data)} bytes; browser part {time.perf_counter() - start:.1f} s)")


def test_malicious_page_runs_no_injected_code_in_chromium(browser, tmp_path):
    page = tmp_path / "malicious.html"
    page.write_text(render_explorer_html(_page(response=MALICIOUS, prompt="<img src=y onerror=alert(3)>")))
    browser.open(page.as_uri())
    assert browser.evaluate("document.querySelectorAll('img, b').length") == 0
    assert browser.evaluate("document.scripts.length") == 2
    text = browser.evaluate("Array.from(document.querySelectorAll('span.tok')).map(s => s.textContent).join('')")
    assert text == MALICIOUS
    assert not any(e.get("method") == "Page.javascriptDialogOpening" for e in browser.events)
    assert not browser.problems(), browser.problems()
