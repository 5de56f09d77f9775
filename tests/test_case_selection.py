"""How the suite picks the cases CI runs (`conftest.py`): of `exhaustive` grids a covering
subset, of `variants` functions the first case, plus every case a mutation patch or the
command line names."""

from __future__ import annotations

import os
import types

from conftest import cases_named_in, covering_cases, items_named, kept_cases


def _case(nodeid: str, *ids: str, path: str = "tests/x.py"):
    return types.SimpleNamespace(nodeid=nodeid, callspec=types.SimpleNamespace(_idlist=ids),
                                 path=path, name=nodeid.rpartition("::")[2])


def test_the_covering_subset_takes_every_value_and_keeps_required_cases():
    grid = [_case(f"t[{a}-{b}]", a, b) for a in ("x", "y") for b in ("0", "1", "2")]
    kept = covering_cases(grid)
    assert {c.callspec._idlist[0] for c in kept} == {"x", "y"}
    assert {c.callspec._idlist[1] for c in kept} == {"0", "1", "2"}
    assert len(kept) == 3
    required = next(c for c in grid if c not in kept)
    assert required in covering_cases(grid, frozenset({required.nodeid}))


def test_cases_named_one_by_one_on_the_command_line_are_found_by_file():
    here = os.getcwd()
    named = cases_named_in(
        ["tests/x.py::test_f[a-b]", "tests/x.py::TestC::test_g[1]", "tests/y.py",
         "tests/x.py::test_h", "-k", "f"], here)
    assert named == {(os.path.realpath(os.path.join(here, "tests/x.py")), "test_f[a-b]"),
                     (os.path.realpath(os.path.join(here, "tests/x.py")), "test_g[1]")}


def test_the_items_named_are_those_a_grid_keeps_whatever_the_covering():
    """Three cases named of a grid whose covering subset needs two: all three kept."""
    here = os.getcwd()
    grid = [_case(f"tests/x.py::t[{a}-{b}]", a, b) for a in ("x", "y") for b in ("0", "1")]
    named = cases_named_in([c.nodeid for c in grid[:3]] + ["tests/x.py::t[a::b]"], here)
    assert (os.path.realpath(os.path.join(here, "tests/x.py")), "t[a::b]") in named
    kept = covering_cases(grid, frozenset(items_named(grid, named)))
    assert {c.nodeid for c in grid[:3]} <= {c.nodeid for c in kept}


def test_a_variants_function_keeps_its_first_case_and_the_named_ones():
    variants = [_case(f"tests/x.py::v[{i}]", str(i)) for i in range(4)]
    grid = [_case(f"tests/x.py::g[{a}-{b}]", a, b) for a in ("x", "y") for b in ("0", "1")]
    kept = kept_cases([grid], [variants], frozenset({variants[2].nodeid}))
    assert {c.nodeid for c in variants if id(c) in kept} == {variants[0].nodeid,
                                                               variants[2].nodeid}
    assert {id(c) for c in covering_cases(grid)} <= kept
