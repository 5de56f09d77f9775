"""The `tokamax-pass` command lines README.md and docs/ show parse as written, and every
option docs/cli.md's table lists exists: a renamed or removed option fails here, not in
a reader's shell. Parsing only, no command runs."""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import shlex

import pytest

from tokamax_pass import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:sh|bash|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, as `cli.main` builds it, and each subcommand's."""
    parser = argparse.ArgumentParser(prog="tokamax-pass")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in cli.COMMANDS:
        importlib.import_module(f"tokamax_pass.commands.{name.replace('-', '_')}").add_parser(
            subparsers)
    return parser, dict(subparsers.choices)


def documented_commands() -> list[tuple[str, list[str]]]:
    """`(page, argv)` of each `tokamax-pass ...` line in a shell block (continuation lines
    joined, comments dropped)."""
    found = []
    for page in PAGES:
        for body in SHELL_BLOCK.findall(page.read_text()):
            for line in body.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["tokamax-pass"]:
                    found.append((str(page.relative_to(ROOT)), words[1:]))
    return found


DOCUMENTED = documented_commands()


def test_the_pages_show_commands():
    assert {argv[0] for _, argv in DOCUMENTED} >= {"demo", "autotune", "export", "inspect",
                                                  "cache", "bound-args"}


@pytest.mark.parametrize("page,argv", DOCUMENTED, ids=lambda v: v if isinstance(v, str)
                         else " ".join(v))
def test_a_documented_command_parses(page, argv, capsys):
    parser, _ = _parser()
    try:
        parser.parse_args(argv)
    except SystemExit:  # argparse's error on stderr names the option
        pytest.fail(f"{page}: tokamax-pass {' '.join(argv)}: {capsys.readouterr().err}")


def _cli_table() -> list[tuple[str, list[str]]]:
    """`(subcommand, the --options its row lists)` of docs/cli.md's table."""
    rows = []
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([\w-]+)`", cells[0]) if len(cells) == 3 else None
        if name:
            rows.append((name[1], re.findall(r"(?<![\w-])(--[\w-]+|-[a-z])\b", cells[2])))
    return rows


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings `parser` takes, its subcommands' (`cache show --device-kind`) too."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _options(sub)
    return options


def test_the_cli_table_lists_options_that_exist():
    _, commands = _parser()
    rows = _cli_table()
    assert {name for name, _ in rows} == set(cli.COMMANDS)
    missing = [f"{name} {option}" for name, options in rows for option in options
               if option not in _options(commands[name])]
    assert missing == []
