"""Every relative link in README.md and the docs points at a file that exists, and a link
to a heading (`page.md#heading`, `#heading`) at a heading that page has."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")),
         *sorted((ROOT / "benchmarks").glob("**/README.md")),
         *sorted((ROOT / "tests").glob("**/README.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
ANCHORED_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def broken_links(page: pathlib.Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text())
            if "://" not in target and not target.startswith("mailto:")
            and not (page.parent / target).exists()]


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but `-` and
    `_` dropped, spaces as `-`; a repeated heading's anchor ends `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCED.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_anchors(page: pathlib.Path) -> list[str]:
    broken = []
    for target, anchor in ANCHORED_LINK.findall(FENCED.sub("", page.read_text())):
        linked = page.parent / target if target else page
        if ("://" not in target and linked.suffix == ".md" and linked.exists()
                and anchor not in anchors(linked)):
            broken.append(f"{target}#{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []
    assert broken_anchors(page) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[ok](there.md) [web](https://example.com) [gone](missing.md#part)")
    assert broken_links(page) == ["missing.md"]


def test_a_broken_anchor_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# The `optimize` pass\n\n## Setup\n\n## Setup\n")
    page.write_text("## Here, too\n\n[a](there.md#the-optimize-pass) [b](there.md#setup-1) "
                    "[c](#here-too) [d](there.md#setup-2) [e](#gone)")
    assert broken_anchors(page) == ["there.md#setup-2", "#gone"]
