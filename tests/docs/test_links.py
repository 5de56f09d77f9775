"""Every relative link in README.md and the docs points at a file that exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")),
         *sorted((ROOT / "benchmarks").glob("**/README.md")),
         *sorted((ROOT / "tests").glob("**/README.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(page: pathlib.Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text())
            if "://" not in target and not target.startswith("mailto:")
            and not (page.parent / target).exists()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[ok](there.md) [web](https://example.com) [gone](missing.md#part)")
    assert broken_links(page) == ["missing.md"]
