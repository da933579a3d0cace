"""The README is a front page and the docs site holds the rest (issue 23): its size, its two commands (the test
command is the one CI runs), the site's pages, and citations of the specification that resolve in the repository.
The site itself is built by ``mkdocs build --strict`` in ``.ci/run``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from disentanglement.config import PRESETS

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 200
    long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 120]
    assert not long, long


def test_readme_first_screen_has_the_two_commands_and_ci_runs_the_test_command():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "bash scripts/setup.sh && .venv/bin/disentangle train --config configs/default.yaml",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
    ]
    assert README.index("```bash") < 1500  # on the first screen, after the three sentences
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/setup.sh" in ci and ".venv/bin/python -m pytest -q" in ci
    assert ci.index("bash scripts/setup.sh") < ci.index(".venv/bin/python -m pytest -q")
    assert any(line.startswith(".venv/bin/mkdocs build --strict") for line in ci)


def _nav_files(nav) -> list[str]:
    files = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_docs_page_is_in_the_nav_and_every_link_of_the_readme_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages
    assert {"index.md", "design.md", "concepts.md", "commands.md", "results.md", "api.md"} <= set(pages)
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).is_file(), target


def test_specification_citations_resolve_in_the_repository():
    design = (ROOT / "docs" / "design.md").read_text()
    anchors = set(re.findall(r"\{#section-(\d+)\}", design))
    assert anchors == {str(n) for n in range(1, 10)}
    cited = set()
    for folder in ("src", "tests", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"(?<!docs/)DESIGN\.md", text), path
            for match in re.finditer(r"docs/design\.md sections? (\d+)(?:-(\d+)| and (\d+))?", text):
                cited |= {n for n in match.groups() if n}
    assert cited and cited <= anchors, cited - anchors


def test_nothing_links_outside_the_repository():
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]:
        assert "../shared" not in path.read_text(encoding="utf-8"), path


def test_the_presets_are_documented():
    commands = (ROOT / "docs" / "commands.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([a-z0-9-]+)` \|", commands, re.M)}
    assert set(PRESETS) <= rows
