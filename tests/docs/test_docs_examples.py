"""Every Python example in README.md and docs/ runs as written on a CPU machine.

A page's ```python blocks are pasted together in order and run as one program, as a
reader would paste them, in a fresh namespace with its own scratch working directory. The
pages run one after another in one Python process (so JAX is imported once), on CPU, with
an empty user cache.
A block whose first line is a comment saying it needs a GPU or TPU (`# needs a GPU`) is
left out. Pages are found by glob, so a new page under docs/ is covered when it lands.
Every fenced block names its language, so a reader (and this test) can tell Python from
shell, Starlark or text.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(\s*)```(.*)$")
NEEDS_DEVICE = re.compile(r"#\s*needs\s+an?\s+(GPU|TPU)\b", re.IGNORECASE)


def pages() -> list[pathlib.Path]:
    """README.md and every markdown page under docs/, in path order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """`(language tag, body)` of each fenced block of `text`, in order."""
    blocks, tag, body = [], None, []
    for line in text.splitlines():
        fence = FENCE.match(line)
        if tag is None:
            if fence:
                tag, body = fence[2].strip(), []
        elif fence and not fence[2].strip():
            blocks.append((tag, "\n".join(body) + "\n"))
            tag = None
        else:
            body.append(line)
    if tag is not None:
        raise ValueError(f"a ```{tag} block is never closed")
    return blocks


def needs_device(block: str) -> bool:
    """Whether the block's first line says it needs a GPU or TPU."""
    first = block.lstrip("\n").splitlines()[0] if block.strip() else ""
    return bool(NEEDS_DEVICE.match(first.strip()))


def runnable_program(page: pathlib.Path) -> str:
    """The page's Python blocks that run on CPU, pasted together in order."""
    blocks = [body for tag, body in code_blocks(page.read_text())
              if tag == "python" and not needs_device(body)]
    return "\n".join(blocks)


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


PAGES_WITH_EXAMPLES = [page for page in pages() if runnable_program(page)]


def test_the_readme_and_the_op_pages_have_examples_that_run_on_cpu():
    covered = {_page_id(page) for page in PAGES_WITH_EXAMPLES}
    assert {"README.md", "docs/ops/attention.md", "docs/ops/layer_norm.md"} <= covered


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_every_code_block_names_its_language(page):
    untagged = [body.splitlines()[0] if body.strip() else "(empty)"
                for tag, body in code_blocks(page.read_text()) if not tag]
    assert not untagged, f"{_page_id(page)}: blocks without a language tag start with {untagged}"


# Runs each page's program (argv: a JSON list of [page id, program, working directory]) in
# a fresh namespace and prints a JSON object {page id: traceback or null}.
RUNNER = """
import json, os, sys, traceback
failures = {}
for page, program, workdir in json.loads(sys.argv[1]):
    os.makedirs(workdir)
    os.chdir(workdir)
    try:
        exec(compile(program, page, "exec"), {"__name__": "__main__"})
        failures[page] = None
    except BaseException:
        failures[page] = traceback.format_exc()
print("RESULTS " + json.dumps(failures))
"""


def test_python_examples_run_as_written_on_cpu(tmp_path):
    """All pages in one process (one test, so pytest-xdist never splits it in two)."""
    jobs = [(_page_id(page), runnable_program(page), str(tmp_path / f"page{i}"))
            for i, page in enumerate(PAGES_WITH_EXAMPLES)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKAMAX_PASS_CACHE_DIR=str(tmp_path / "cache"))
    path = [str(ROOT / "src"), str(ROOT / "kernels"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, f"the examples' process failed:\n{done.stderr[-4000:]}"
    failures = json.loads(lines[-1].removeprefix("RESULTS "))
    assert sorted(failures) == sorted(page_id for page_id, _, _ in jobs)
    failed = {page: trace for page, trace in failures.items() if trace is not None}
    assert not failed, "Python examples that fail when pasted in order:\n" + "\n".join(
        f"{page}:\n{trace}" for page, trace in failed.items())


GENERATED = re.compile(r"<!-- report:(\w+) -->.*?<!-- /report:\1 -->|<!--fig .*?<!--/fig-->",
                       re.S)
HISTORY = re.compile(r"\bsession \d+|\bstep \d+\b|_s\d+[a-z]?(_\w+)?\.(json|jsonl|txt|log)\b",
                     re.IGNORECASE)


def test_the_readme_stays_a_short_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_pages_say_what_is_not_when(page):
    """Outside the blocks `benchmarks.report` writes, no page narrates sessions or steps or
    cites a run's results file by name."""
    prose = GENERATED.sub("", page.read_text())
    found = sorted({m.group(0) for m in HISTORY.finditer(prose)})
    assert not found, f"{_page_id(page)} narrates history: {found}"


def test_code_blocks_are_parsed_with_their_tags_and_device_markers():
    text = ("intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
            "```python\n# needs a GPU\ny = 2\n```\n```\nuntagged\n```\n")
    blocks = code_blocks(text)
    assert [tag for tag, _ in blocks] == ["python", "bash", "python", ""]
    assert [needs_device(body) for _, body in blocks] == [False, False, True, False]
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```python\nx = 1\n")
