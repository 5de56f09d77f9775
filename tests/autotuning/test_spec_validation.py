"""Loaders check each bound-arguments spec against its op (signature, kinds of values,
`bind`'s own checks) and each measurement's fields: a bad entry is a `SpecError` naming
it when read (or, not strict, a `BadEntryWarning` and the entry skipped), never a
failure later, deep inside autotuning or a kernel."""

from __future__ import annotations

import copy
import json

import pytest

from tokamax_pass.autotuning import bound_args_from_json
from tokamax_pass.autotuning.result import FORMAT, AutotuningResult, BadEntryWarning
from tokamax_pass.core.spec import SpecError

_ATTENTION = {
    "op": {"dataclass": "tokamax_kernels.attention.xla_chunked.XlaChunkedDotProductAttention",
           "fields": {"config": None, "vjp": None}},
    "arguments": {"query": "bf16[2,64,2,64]", "key": "bf16[2,64,2,64]",
                  "value": "bf16[2,64,2,64]", "bias": None, "mask": None, "is_causal": True,
                  "scale": 0.125, "query_seq_lengths": None, "key_value_seq_lengths": None,
                  "local_window_size": None, "logits_soft_cap": None, "precision": None},
}


def _with(**changes):
    entry = copy.deepcopy(_ATTENTION)
    for name, value in changes.items():
        if value is _MISSING:
            del entry["arguments"][name]
        else:
            entry["arguments"][name] = value
    return entry


_MISSING = object()

_BAD_ARGUMENTS = [
    ({"query": _MISSING}, r"missing the arguments \['query'\]"),
    ({"no_such_arg": 1}, r"takes no arguments named \['no_such_arg'\]"),
    ({"is_causal": "yes"}, r"argument 'is_causal' must be bool, got 'yes'"),
    ({"scale": "x"}, r"argument 'scale' must be float, got 'x'"),
    ({"key": "abc"}, r"argument 'key' must be jax.Array, got 'abc'"),
    ({"local_window_size": [1, "a"]}, r"'local_window_size' must be tuple\[int, int\] \| None"),
    ({"key": "bf16[3,7,5,9]"}, r"bind rejects these arguments: .*batch 3 != query batch 2"),
    ({"scale": float("nan")}, r"bind rejects these arguments: .*scale must be a finite"),
    ({"scale": 10**400}, r"bind rejects these arguments: .*"),
    ({"logits_soft_cap": -1.0}, r"bind rejects these arguments: .*logits_soft_cap"),
    # Loaded, then autotuning failed deep in MLIR (`TypeError: get(): incompatible
    # function arguments`) or in drawing the random inputs.
    ({"key": "bf16[2,99999999999999999999,2,64]"},
     r"has a dimension above 9223372036854775807 \(2\*\*63 - 1\)"),
    ({"key": "bf16[2,9223372036854775807,2,64]"}, r"holds more than 9223372036854775807"),
]


def test_a_good_entry_loads():
    (ba,) = bound_args_from_json(json.dumps([_ATTENTION]))
    assert ba.arguments["query"].shape == (2, 64, 2, 64) and ba.arguments["is_causal"] is True


@pytest.mark.parametrize("changes,match", _BAD_ARGUMENTS)
def test_bound_args_from_json_rejects_an_entry_its_op_does_not_take(changes, match):
    text = json.dumps([_ATTENTION, _with(**changes)])
    with pytest.raises(SpecError, match=rf"bound-arguments JSON: entry 1: .*{match}"):
        bound_args_from_json(text)
    with pytest.warns(BadEntryWarning, match=r"skipping .*entry 1: "):
        assert len(bound_args_from_json(text, strict=False)) == 1


def _result(entry_json):
    return json.dumps({"format": FORMAT, "schema_version": 1, "device_kind": "cpu",
                       "entries": [entry_json]})


def _measured(arguments_entry=_ATTENTION, **fields):
    config = {"config": {"chunk_q": 64, "chunk_k": 64}, "evaluation_times_ms": [1.0],
              **fields}
    return {**arguments_entry, "provenance": None, "configs": [config]}


def test_a_good_result_entry_loads():
    result = AutotuningResult.loads(_result(_measured(lower_time_ms=2.5)), strict=True)
    ((_, data),) = result.data
    assert [m.lower_time_ms for m in data.values()] == [2.5]


@pytest.mark.parametrize("changes,match", _BAD_ARGUMENTS[:3])
def test_result_loads_rejects_arguments_its_op_does_not_take(changes, match):
    text = _result(_measured(_with(**changes)))
    with pytest.raises(SpecError, match=rf"entry 0: .*{match}"):
        AutotuningResult.loads(text, strict=True)
    with pytest.warns(BadEntryWarning, match="entry 0"):
        assert len(AutotuningResult.loads(text)) == 0


@pytest.mark.parametrize("fields,match", [
    ({"lower_time_ms": "abc"}, "'lower_time_ms' must be a number >= 0 or null, got 'abc'"),
    ({"compile_time_ms": -1}, "'compile_time_ms' must be a number >= 0"),
    ({"peak_memory_mb": [1]}, r"'peak_memory_mb' must be a number >= 0 or null, got \[1\]"),
    ({"error": 5}, "'error' must be a string or null, got 5"),
])
def test_result_loads_rejects_measurement_fields_of_the_wrong_kind(fields, match):
    text = _result(_measured(**fields))
    with pytest.raises(SpecError, match=rf"entry 0: {match}"):
        AutotuningResult.loads(text, strict=True)
    with pytest.warns(BadEntryWarning, match="entry 0"):
        assert len(AutotuningResult.loads(text)) == 0


@pytest.mark.parametrize("fields", [
    {"evaluation_times_ms": [10**400]},  # an integer no float holds: OverflowError
    {"evaluation_times_ms": [1.0, float("inf")]},
    {"evaluation_times_ms": [float("nan")]},
    {"lower_time_ms": 10**400},
    {"compile_time_ms": float("inf")},
    {"peak_memory_mb": float("nan")},
])
def test_result_loads_rejects_times_no_float_holds_or_not_finite(fields):
    text = _result(_measured(**fields))
    (name,) = fields
    with pytest.raises(SpecError, match=rf"entry 0: '{name}' must be"):
        AutotuningResult.loads(text, strict=True)
    with pytest.warns(BadEntryWarning, match="entry 0"):
        assert len(AutotuningResult.loads(text)) == 0


@pytest.mark.parametrize("field,value,match", [
    ("schema_version", True, "no integer 'schema_version'"),
    ("schema_version", -1, "schema version -1, which no tokamax_pass writes"),
    ("schema_version", 0, "schema version 0, which no tokamax_pass writes"),
    ("tokamax_pass_version", 3, "'tokamax_pass_version' must be a string or null"),
    ("jax_version", [], "'jax_version' must be a string or null"),
    # Loaded, then saved to a cache file named after it: `ValueError: embedded null byte`,
    # `OSError: File name too long`, a file name with a newline.
    ("device_kind", "cpu\x00", r"device_kind 'cpu\\x00' is not a device kind JAX reports"),
    ("device_kind", "cpu\n", r"device_kind 'cpu\\n' is not a device kind JAX reports"),
    ("device_kind", "x" * 300, r"is not a device kind JAX reports \(printable text of at "
                               r"most 200 characters"),
])
def test_result_loads_rejects_header_fields_of_the_wrong_kind(field, value, match):
    document = json.loads(_result(_measured()))
    document[field] = value
    with pytest.raises(SpecError, match=match):
        AutotuningResult.loads(json.dumps(document))


def _mlir_attribute(quoted):
    return f'  %{len(quoted)} = stablehlo.custom_call @k() {{tokamax_pass_spec = "{quoted}"}}\n'


@pytest.mark.parametrize("bad,match", [
    (_mlir_attribute("\\q"), "not a valid quoted string"),
    ('  %9 = custom-call(), frontend_attributes={tokamax_pass_spec={"op": {"dataclass"\n',
     "not valid JSON"),
])
def test_get_bound_args_skips_an_unreadable_spec_in_text_and_reads_the_others(bad, match):
    from tokamax_pass.autotuning import get_bound_args

    good = json.dumps(_ATTENTION).replace("\\", "\\5C").replace('"', "\\22")
    with pytest.warns(UserWarning, match=f"skipping an op call .*{match}"):
        (ba,) = get_bound_args("module {\n" + _mlir_attribute(good) + bad + "}")
    assert ba.arguments["query"].shape == (2, 64, 2, 64)
    with pytest.raises(SpecError, match=match):
        get_bound_args("module {\n" + bad + "}")


def test_a_key_given_twice_in_one_object_is_refused_not_dropped():
    """A hand-merged file with two `"entries"` lists loaded the last one alone, and an
    entry naming an argument twice kept its last value, silently."""
    text = _result(_measured())
    doubled = text.replace('"entries": [', '"entries": [], "entries": [', 1)
    assert json.loads(doubled)["entries"]  # what json alone keeps: the last list
    with pytest.raises(SpecError, match="gives the key 'entries' twice in one object"):
        AutotuningResult.loads(doubled)
    twice = json.dumps([_ATTENTION]).replace('"is_causal": true', '"is_causal": true, '
                                             '"is_causal": false')
    with pytest.raises(SpecError, match="gives the key 'is_causal' twice"):
        bound_args_from_json(twice)


@pytest.mark.parametrize("fields,match", [
    ({"interpret": "no"}, "field 'interpret' must be bool, got 'no'"),
    ({"vjp": 5}, r"field 'vjp' must be tokamax_pass.core.op.Op \| None, got 5"),
    ({"config": {"dataclass": "tokamax_kernels.attention.xla_chunked.XlaChunkedConfig",
                 "fields": {"chunk_q": 64, "chunk_k": 64}}},
     r"field 'config' must be .*PallasTritonFlashAttentionConfig \| None, got XlaChunkedConfig"),
    ({"vjp": {"dataclass": "tokamax_pass.core.vjp.AutodiffVjp", "fields": {"forward": 5}}},
     "AutodiffVjp: field 'forward' must be Op, got 5"),
])
def test_an_op_field_of_the_wrong_kind_is_refused(fields, match):
    """An op's fields were taken as a file gave them: `interpret: "no"` ran the kernel
    interpreted, and another op's config (or a `vjp` of 5) failed when the op ran."""
    entry = copy.deepcopy(_ATTENTION)
    entry["op"]["dataclass"] = "tokamax_kernels.attention.pallas_triton.PallasTritonFlashAttention"
    entry["op"]["fields"].update(fields)
    with pytest.raises(SpecError, match=rf"entry 0: .*{match}"):
        bound_args_from_json(json.dumps([entry]))
