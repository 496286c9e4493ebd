"""The README is the front door: it links every topic page, and every relative link in the README and
in the topic pages leads to a file that exists (and to a heading that exists, for #anchors).

TOPIC_PAGES are the pages checked; a new page joins the list (and the README's links).
PAGES_OF_OTHER_TOPICS land in docs/ with their own features: the README links them by name, and
links to them are accepted while they are not in the tree yet.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TOPIC_PAGES = {"architecture.md", "operations.md", "openai-api.md", "security.md", "scaling.md", "memory.md",
               "speculation.md", "quantization.md", "kernels.md", "performance.md", "performance-tables.md",
               "cpu-limits.md", "structured-output.md", "tool-calling.md", "responses-api.md", "kv-tiers.md",
               "reliability.md", "request-failures.md", "kernel-interface.md", "quantization-accuracy.md",
               "testing.md", "lora.md"}
PAGES_OF_OTHER_TOPICS: set[str] = set()
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.+)$")
FENCE = re.compile(r"^```")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *(DOCS / name for name in sorted(TOPIC_PAGES))]


def prose_lines(path: Path) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, is_code = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            is_code = not is_code
        elif not is_code:
            lines.append(line)
    return lines


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"[`*]", "", title.strip().lower())
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found = set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if match:
            found.add(anchor(match.group(1)))
        found.update(re.findall(r'<a id="([^"]+)"', line))
    return found


def relative_links(path: Path) -> list[str]:
    return [target for line in prose_lines(path) for target in LINK.findall(line)
            if not re.match(r"^[a-z]+:", target)]


def test_every_relative_link_resolves():
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if file_part and linked.parent == DOCS and linked.name in PAGES_OF_OTHER_TOPICS and not linked.exists():
                continue
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_readme_links_every_topic_page():
    linked = {Path(target.partition("#")[0]).name for target in relative_links(ROOT / "README.md")
              if target.startswith("docs/")}
    assert (TOPIC_PAGES | PAGES_OF_OTHER_TOPICS) - linked == set()


def test_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_long_pages_have_a_table_of_contents():
    long_pages = [DOCS / name for name in TOPIC_PAGES if len((DOCS / name).read_text().splitlines()) > 150]
    assert long_pages
    assert [path.name for path in long_pages if "<!-- toc -->" not in path.read_text()] == []
