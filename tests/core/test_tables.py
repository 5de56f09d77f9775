"""`tokamax_pass.tables.render_table`: the one plain-text table renderer."""

import pytest

from tokamax_pass.tables import render_table


def test_columns_are_padded_to_their_widest_cell_under_a_rule_of_dashes():
    text = render_table(("op", "ms"), [("LayerNorm", "1.5"), ("X", "10.25")])
    header, rule, first, second = text.splitlines()
    assert header.split() == ["op", "ms"] and set(rule) == {"-", " "}
    ms_column = header.index("ms")
    assert rule[ms_column - 1] == " " and rule[ms_column:] == "-" * len("10.25")
    assert first[ms_column:] == "1.5" and second[ms_column:] == "10.25"
    assert first.startswith("LayerNorm") and second.startswith("X ")


def test_cells_are_text_not_markup_and_never_wrap():
    long_cell = "x" * 500
    text = render_table(("arguments", "note"), [("bf16[8,128]", f"[bold]{long_cell}")])
    row = text.splitlines()[2]
    assert "bf16[8,128]" in row and f"[bold]{long_cell}" in row
    assert len(text.splitlines()) == 3


def test_right_aligned_columns_indent_and_no_trailing_spaces():
    text = render_table(("name", "n"), [("a", 1), ("bbbb", 100)], right_aligned=("n",),
                        indent=2)
    lines = text.splitlines()
    assert all(line.startswith("  ") and line == line.rstrip() for line in lines)
    assert lines[2].endswith("  1") and lines[3].endswith("100")
    assert lines[2].index("1") == lines[3].index("100") + 2


def test_a_row_with_the_wrong_number_of_cells_is_an_error():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        render_table(("a", "b", "c"), [("1", "2")])


def test_a_table_without_rows_is_its_header():
    assert render_table(("op", "ms"), []).splitlines()[0].split() == ["op", "ms"]
