"""Plain-text tables, rendered by `rich`, for the CLI, reprs and benchmark scripts.

The text goes to terminals, logs, files and tests alike, so it is ASCII, carries no
colour or markup, and never wraps: a header, a rule of dashes under each column, then
one line per row.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

# A header rule of dashes, one run per column, and no other lines.
_HEADER_RULE = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)
# Wide enough that no table wraps.
_NO_WRAP_WIDTH = 100_000


def render_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *,
                 right_aligned: Collection[str] = (), indent: int = 0) -> str:
    """`rows` under `columns`, each column as wide as its widest cell.

    Cells are shown as `str(cell)`, never read as markup (`bf16[8,128]` stays as it is);
    the columns named in `right_aligned` are aligned right (numbers); every line starts
    with `indent` spaces and ends without trailing spaces.
    """
    # One space of padding right of each cell and the rule's gap: two spaces between columns.
    table = Table(box=_HEADER_RULE, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for name in columns:
        table.add_column(name, justify="right" if name in right_aligned else "left",
                         no_wrap=True)
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a table row has {len(row)} cells for {len(columns)} columns: "
                             f"{row!r}")
        table.add_row(*(Text(str(cell)) for cell in row))
    out = io.StringIO()
    console = Console(file=out, width=_NO_WRAP_WIDTH, color_system=None, force_terminal=False,
                      highlight=False, markup=False, emoji=False)
    console.print(table)
    return "\n".join(" " * indent + line.rstrip() for line in out.getvalue().splitlines())
