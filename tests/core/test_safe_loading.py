"""No file makes the library import or run anything: every loader resolves the classes
and functions a spec names through the allowlist (`register_serializable`), and bounds
what it reads (nesting, sizes, config limits)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import subprocess
import sys
import threading
import uuid
import warnings

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tk
from conftest import random_normal
from tokamax_pass import cli
from tokamax_pass.autotuning import cache as cache_lib
from tokamax_pass.autotuning import discovery, keys
from tokamax_pass.autotuning import result as result_lib
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.autotuning.result import AutotuningResult, BadEntryWarning
from tokamax_pass.core import BoundArguments, NullConfig, Op, spec
from tokamax_pass.core.spec import SpecError
from tokamax_pass.tools import xplane_to_bound_args

LAYER_NORM = "tokamax_kernels.layer_norm.base.LayerNorm"
NOT_REGISTERED = "not a registered serializable object.*register_serializable"
X = random_normal(0, (2, 8, 32))
SCALE = random_normal(1, (32,))


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A module on `sys.path` that writes a marker file when imported (and a command that
    writes it): a payload that imports or runs anything leaves the file behind."""
    name = f"mark{uuid.uuid4().hex[:10]}"
    path = tmp_path / f"{name}.marked"
    (tmp_path / f"{name}.py").write_text(
        "import enum, pathlib\n"
        f"pathlib.Path({str(path)!r}).write_text('imported')\n"
        "class Thing:\n    def __init__(self, **kwargs):\n        pass\n"
        "class Color(enum.Enum):\n    RED = 1\n"
        "def act(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, path
    assert not path.exists(), "a payload imported a module or ran a command"
    assert name not in sys.modules, "a payload imported a module"


def _payloads(name: str, path: pathlib.Path) -> list[dict]:
    return [
        {"dataclass": "os.system", "fields": {"command": f"touch {path}"}},
        {"callable": "os.system"},
        {"dataclass": "subprocess.Popen", "fields": {"args": ["touch", str(path)]}},
        {"callable": "builtins.eval"},
        {"dataclass": f"{name}.Thing", "fields": {}},
        {"dataclass": f"{name}:Thing", "fields": {}},
        {"callable": f"{name}.act"},
        {"enum": f"{name}.Color", "name": "RED"},
    ]


PAYLOAD_IDS = ["os.system", "callable os.system", "subprocess.Popen", "builtins.eval",
               "module.Thing", "module:Thing", "module.act", "module enum"]


def _bound_spec(payload: dict | None = None, *, in_argument: bool = False) -> dict:
    """A layer-norm call's spec, its op (or, `in_argument`, its `epsilon`) replaced."""
    data = _layer_norm_bound().to_spec()
    if payload is not None and in_argument:
        data["arguments"]["epsilon"] = payload
    elif payload is not None:
        data["op"] = payload
    return data


def _layer_norm_bound() -> BoundArguments:
    return keys.canonical(tk.LayerNorm().bind(X, SCALE, None))


def _document(*ops: dict) -> str:
    """A result document of layer-norm entries, the op of each replaced by `ops`."""
    entry = Entry(_layer_norm_bound(), {NullConfig(): Measurement((1.0,))},
                  keys.provenance(tk.LayerNorm()))
    data = json.loads(AutotuningResult(jax.devices()[0].device_kind, [entry]).dumps())
    good = data["entries"][0]
    data["entries"] = [{**good, "op": op} for op in ops] + [good]
    return json.dumps(data)


@pytest.fixture(params=range(len(PAYLOAD_IDS)), ids=PAYLOAD_IDS)
def payload(request, marker):
    return _payloads(*marker)[request.param]


# --- the public loaders -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [[], {"a": 1}, 3, None], ids=["list", "object", "int", "null"])
def test_a_dtype_that_is_not_a_name_is_a_spec_error(dtype):
    text = json.dumps({"op": {"dataclass": "tokamax_kernels.ragged_dot.base.RaggedDot",
                              "fields": {}},
                       "arguments": {"precision": {"dtype": dtype}}})
    with pytest.raises(SpecError, match="unknown dtype"):
        BoundArguments.from_json(text)
    with pytest.raises(SpecError, match="unknown dtype"):
        tk.autotuning.bound_args_from_json(f"[{text}]")


@pytest.mark.parametrize("in_argument", [False, True], ids=["op", "argument"])
def test_bound_arguments_from_json_resolves_no_payload(payload, in_argument):
    text = json.dumps(_bound_spec(payload, in_argument=in_argument))
    with pytest.raises(SpecError, match=NOT_REGISTERED):
        BoundArguments.from_json(text)
    with pytest.raises(SpecError, match=NOT_REGISTERED):
        tk.autotuning.bound_args_from_json(f"[{text}]")


def test_result_loads_skips_a_payload_entry_and_keeps_the_rest(payload, tmp_path):
    text = _document(payload)
    with pytest.warns(BadEntryWarning, match=rf"entry 0: .*{NOT_REGISTERED}"):
        result = AutotuningResult.loads(text)
    assert [type(e.bound.op).__name__ for e in result.entries] == ["LayerNorm"]
    with pytest.raises(SpecError, match=rf"entry 0: .*{NOT_REGISTERED}"):
        AutotuningResult.loads(text, strict=True)
    path = tmp_path / "result.json"
    path.write_text(text)
    with pytest.warns(BadEntryWarning, match="entry 0"):
        assert len(AutotuningResult.load(path).entries) == 1


# --- caches read in passing ---------------------------------------------------------------

@pytest.fixture
def poisoned_user_cache(tmp_path, monkeypatch, marker):
    folder = tmp_path / "user_cache"
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(folder))
    cache_lib._USER.invalidate()
    path = cache_lib.cache_file(jax.devices()[0].device_kind)
    path.parent.mkdir(parents=True)
    path.write_text(_document(*_payloads(*marker)))
    yield path
    cache_lib._USER.invalidate()


def _norm(x, scale):
    return jnp.sum(tk.layer_norm(x, scale, None) ** 2)


def test_an_op_call_skips_poisoned_user_cache_entries(poisoned_user_cache):
    with pytest.warns(BadEntryWarning, match=rf"{poisoned_user_cache.name}.*entry 0: "):
        out = tk.layer_norm(X, SCALE, None)
    assert out.shape == X.shape


def test_optimize_skips_poisoned_user_cache_entries(poisoned_user_cache):
    with pytest.warns(BadEntryWarning, match="entry [0-7]: .*os.system"):
        out = tk.optimize(_norm)(X, SCALE)
    assert jnp.isfinite(out)


# --- the command line -----------------------------------------------------------------------

def test_cli_cache_import_skips_payload_entries(payload, tmp_path):
    path = tmp_path / "shared.json"
    path.write_text(_document(payload))
    with pytest.warns(BadEntryWarning, match=f"entry 0: .*{NOT_REGISTERED}"):
        assert cli.main(["cache", "--cache-dir", str(tmp_path / "c"), "import", str(path)]) == 0
    [saved] = (tmp_path / "c").glob("*.json")
    assert [type(e.bound.op).__name__ for e in cache_lib.read(saved).entries] == ["LayerNorm"]


def test_cli_export_results_skips_payload_entries(payload, tmp_path):
    path = tmp_path / "results.json"
    path.write_text(_document(payload))
    with pytest.warns(BadEntryWarning, match=f"entry 0: .*{NOT_REGISTERED}"):
        assert cli.main(["export", "test_safe_loading:_norm", "--args", "f32[2,8,32]",
                         "f32[32]", "--results", str(path), "-o", str(tmp_path / "a")]) == 0


def test_cli_autotune_bound_args_file_is_refused(payload, tmp_path, monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    path = tmp_path / "bound.json"
    path.write_text(json.dumps([_bound_spec(payload)]))
    with pytest.raises(SystemExit, match=f"autotune: SpecError: .*{NOT_REGISTERED}"):
        cli.main(["autotune", "--bound-args", str(path), "-o", str(tmp_path / "r.json")])


def _poisoned_profile(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A real profile of a layer-norm call whose recorded op names `name` instead (padded
    with JSON whitespace to the same length, so the protobuf stays intact)."""
    with jax.profiler.trace(str(tmp_path / "trace")):
        jax.block_until_ready(jax.jit(lambda x, s: tk.layer_norm(x, s, None))(X, SCALE))
    [xplane] = glob.glob(str(tmp_path / "trace" / "**" / "*.xplane.pb"), recursive=True)
    genuine = f'"dataclass":"{LAYER_NORM}"'.encode()
    poisoned = f'"dataclass":"{name}"'.encode()
    data = pathlib.Path(xplane).read_bytes()
    assert genuine in data and len(poisoned) <= len(genuine)
    data = data.replace(genuine, poisoned + b" " * (len(genuine) - len(poisoned)))
    path = tmp_path / "poisoned.xplane.pb"
    path.write_bytes(data)
    return path


def test_profiles_name_no_code(tmp_path, marker, monkeypatch):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    name, _ = marker
    path = _poisoned_profile(tmp_path, f"{name}.Thing")
    with pytest.warns(UserWarning, match=f"cannot be loaded here: .*{NOT_REGISTERED}"):
        bound = xplane_to_bound_args.bound_args_from_xplane(path)
    assert "LayerNorm" not in {type(b.op).__name__ for b in bound}
    with pytest.warns(UserWarning, match=NOT_REGISTERED):
        assert cli.main(["bound-args", "--xplane_file", str(path),
                         "-o", str(tmp_path / "b.json")]) == 0
    listed = json.loads((tmp_path / "b.json").read_text())["bound_arguments"]
    assert LAYER_NORM not in json.dumps(listed) and name not in json.dumps(listed)


def test_a_damaged_profile_entry_is_skipped_and_the_others_load(tmp_path):
    """An XSpace whose spec entry is not UTF-8, or ends inside its length, raised a bare
    `UnicodeDecodeError` or `ValueError("truncated varint")`, and lost every op call."""
    path = _poisoned_profile(tmp_path, LAYER_NORM)
    profile, prefix = path.read_bytes(), xplane_to_bound_args._ENTRY_PREFIX
    # Every program this process loaded (other tests' too) is in the profile.
    undamaged = xplane_to_bound_args.bound_args_from_xplane(path)
    assert LAYER_NORM in {spec.import_path(type(b.op)) for b in undamaged}
    for damaged, why in ((prefix + b"\x02\xff\xfe", "codec can't decode"),
                         (prefix + b"\xff", "runs past the end of the file")):
        # An unknown field (15, length-delimited) of the XSpace: it still parses.
        path.write_bytes(profile + bytes([0x7A, len(damaged)]) + damaged)
        with pytest.warns(UserWarning, match=f"poisoned.xplane.pb: skipped a .* {why}"):
            bound = xplane_to_bound_args.bound_args_from_xplane(path)
        assert bound == undamaged


def test_a_profile_larger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A profile is read whole: one past this machine's memory (a sparse file) is a clear
    error naming it, not a `MemoryError`."""
    path = _poisoned_profile(tmp_path, LAYER_NORM)
    monkeypatch.setattr(spec, "physical_memory_bytes", lambda: 1 << 20)
    with open(path, "r+b") as f:
        f.truncate((1 << 20) + 1)  # sparse where the file system allows it
    with pytest.raises(spec.SpecError, match=r"poisoned.xplane.pb is 1048577 bytes long, "
                                             r"more than this machine's 1048576 bytes"):
        xplane_to_bound_args.bound_args_from_xplane(path)


# --- StableHLO metadata and manifests -----------------------------------------------------

def _poisoned_stablehlo(name: str) -> str:
    text = jax.jit(lambda x, s: tk.layer_norm(x, s, None)).lower(X, SCALE).as_text()
    assert LAYER_NORM in text
    return text.replace(LAYER_NORM, name)


def test_stablehlo_metadata_names_no_code(marker):
    name, _ = marker
    text = _poisoned_stablehlo(f"{name}.Thing")
    assert [op.implementation for op in tk.inspect(text).ops] == ["?"]
    with pytest.raises(SpecError, match=NOT_REGISTERED):
        discovery.bound_args_from_specs(discovery.specs_from_text(text))
    with pytest.raises(SpecError, match=NOT_REGISTERED):
        tk.autotuning.get_bound_args(text)


def test_a_manifest_payload_is_data_only(marker, tmp_path):
    directory = tk.export(_norm, X, SCALE).save(tmp_path / "artifact")
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["ops"][0]["op"] = _payloads(*marker)
    manifest_path.write_text(json.dumps(manifest))
    loaded = tk.load_artifact(directory)
    assert float(loaded(X, SCALE)) == pytest.approx(float(_norm(X, SCALE)), rel=1e-5)
    str(tk.inspect(directory))
    manifest["versions"] = _nested(200)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="deeper than 64"):
        tk.load_artifact(directory)


# --- registered user code still round-trips -------------------------------------------------

@tk.register_serializable
@dataclasses.dataclass(frozen=True)
class TwiceConfig:
    factor: int = 2


@tk.register_serializable
@dataclasses.dataclass(frozen=True, kw_only=True)
class Twice(Op[TwiceConfig]):
    config_cls = TwiceConfig

    def _fwd(self, x, *, activation, config, return_residuals):
        return activation(x) * (config or TwiceConfig()).factor, None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NeverRegistered(Op):
    def _fwd(self, x, *, config, return_residuals):
        return x, None


def custom_activation(x):
    return jnp.tanh(x) * 0.5


def test_a_registered_user_op_and_activation_round_trip():
    tk.register_serializable(custom_activation)
    bound = Twice(config=TwiceConfig(3)).bind(X, activation=custom_activation)
    again = BoundArguments.from_json(bound.to_json())
    assert again.op == bound.op and again.arguments["activation"] is custom_activation
    assert again.to_json() == bound.to_json()
    again = BoundArguments.from_json(Twice().bind(X, activation=jax.nn.gelu).to_json())
    assert again.arguments["activation"] is jax.nn.gelu


def test_an_unregistered_user_op_names_the_fix():
    with pytest.raises(SpecError, match=f"'test_safe_loading.NeverRegistered' is "
                                        f"{NOT_REGISTERED}"):
        BoundArguments.from_json(NeverRegistered().bind(X).to_json())
    with pytest.raises(TypeError, match="not a dataclass, an enum class or a function"):
        tk.register_serializable(object())


def test_every_shipped_library_cache_entry_resolves():
    folder = pathlib.Path(tk.__file__).parent / "data" / "autotuning"
    files = sorted(folder.glob("*/*.json"))
    assert files
    for path in files:
        text = path.read_text()
        with warnings.catch_warnings():
            warnings.simplefilter("error", BadEntryWarning)
            result = AutotuningResult.loads(text, strict=True, what=path.name)
        assert len(result.entries) == len(json.loads(text)["entries"]), path.name
        for entry in result.entries:
            ops = [entry.bound.op, getattr(entry.bound.op, "forward", None)]
            assert all(spec.is_registered(type(op)) for op in ops if op is not None)


# --- bounded input -----------------------------------------------------------------------------

def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("load", [
    lambda t: spec.loads(t, what="x"),
    BoundArguments.from_json,
    AutotuningResult.loads,
    tk.autotuning.bound_args_from_json,
    lambda t: discovery.specs_from_text(f"tokamax_pass_spec={{\"a\":{t}}}"),
], ids=["spec.loads", "BoundArguments.from_json", "AutotuningResult.loads",
        "bound_args_from_json", "HLO text metadata"])
def test_deep_nesting_is_a_spec_error(load):
    with pytest.raises(SpecError, match="deeper than 64"):
        load(DEEP)


def test_sizes_are_bounded(monkeypatch):
    data = _bound_spec()
    data["arguments"]["epsilon"] = _nested(spec.MAX_DEPTH + 2)
    with pytest.raises(SpecError, match="nested deeper than 64"):
        BoundArguments.from_spec(data)
    data["arguments"]["epsilon"] = list(range(spec.MAX_ITEMS + 1))
    with pytest.raises(SpecError, match=f"at most {spec.MAX_ITEMS}"):
        BoundArguments.from_spec(data)
    data["arguments"]["epsilon"] = "a" * (spec.MAX_STRING_CHARS + 1)
    with pytest.raises(SpecError, match=f"at most {spec.MAX_STRING_CHARS}"):
        BoundArguments.from_spec(data)
    data["arguments"]["epsilon"] = "f32[" + ",".join(["2"] * 17) + "]"
    with pytest.raises(SpecError, match="at most 16 dimensions"):
        BoundArguments.from_spec(data)
    monkeypatch.setattr(spec, "MAX_ITEMS", 2)
    with pytest.raises(SpecError, match="holds 3 bound arguments, above the 2"):
        tk.autotuning.bound_args_from_json(json.dumps([_bound_spec()] * 3))
    monkeypatch.setattr(result_lib, "MAX_ENTRIES", 1)
    with pytest.raises(SpecError, match="has 2 entries, above the 1 a result may hold"):
        AutotuningResult.loads(_document({"dataclass": LAYER_NORM}))
    monkeypatch.setattr(spec, "MAX_JSON_CHARS", 100)
    with pytest.raises(SpecError, match="above the 100 a loader reads"):
        BoundArguments.from_json(json.dumps(_bound_spec()))


def test_a_spec_sets_no_field_that_specs_leave_out():
    """`bypass_device_check` is how a call is made, never written to a spec: a file that
    set it had autotuning time a GPU kernel on the CPU."""
    data = _bound_spec()
    data["op"]["fields"]["bypass_device_check"] = True
    with pytest.raises(SpecError, match=r"no fields \['bypass_device_check'\] a spec may give"):
        BoundArguments.from_spec(data)


def test_a_file_above_the_size_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A file above the bound is refused from its size, before it is read: a sparse file
    of a terabyte is a clear error, not a `MemoryError` (in the user cache: on every op
    call)."""
    monkeypatch.setattr(spec, "MAX_JSON_CHARS", 1000)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2**20)  # sparse where the file system allows it
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "manifest.json").symlink_to(big)
    for load in (tk.AutotuningResult.load, tk.autotuning.bound_args_from_json,
                 cache_lib.read, tk.load_artifact):
        with pytest.raises(SpecError, match=r"is 1048576 bytes long, above the 1000"):
            load(artifact if load is tk.load_artifact else big)


def _pipe_of(tmp_path, data):
    """A named pipe (its size reads 0) a thread writes `data` into once it is opened."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def write():
        with open(pipe, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()
    return pipe


@pytest.mark.parametrize("reader", [spec.read_file, spec.read_binary_file],
                         ids=lambda f: f.__name__)
def test_a_pipe_is_read_whole(tmp_path, reader):
    """A file whose size reads 0 (a pipe, `/dev/stdin`) is read to its end, not cut to
    the one byte past its stated size."""
    data = b'{"serialized": "program"}'
    assert reader(_pipe_of(tmp_path, data), what="pipe") == data


def test_a_pipe_above_the_size_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(spec, "MAX_JSON_CHARS", 10)
    with pytest.raises(SpecError, match=r"pipe is 11 bytes long, above the 10"):
        spec.read_file(_pipe_of(tmp_path, b"x" * 100), what="pipe")


def test_configs_are_bounded_in_code_and_from_files():
    config_cls = tk.XlaChunkedDotProductAttention.config_cls
    with pytest.raises(ValueError, match=r"XlaChunkedConfig.chunk_q=1000000000 is above its "
                                         r"limit of 1048576"):
        tk.XlaChunkedDotProductAttention(config=config_cls(chunk_q=10**9, chunk_k=64))
    triton_cls = tk.PallasTritonFlashAttention.config_cls
    with pytest.raises(ValueError, match="num_stages=9 is above its limit of 8"):
        tk.PallasTritonFlashAttention(config=triton_cls(num_stages=9))
    with pytest.raises(ValueError, match="num_warps=64 is above its limit of 32"):
        tk.PallasTritonFlashAttention(config=triton_cls(num_warps=64))
    q = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.float32)
    bound = keys.canonical(tk.XlaChunkedDotProductAttention().bind(q, q, q))
    good, huge = config_cls(chunk_q=8, chunk_k=8), config_cls(chunk_q=16, chunk_k=8)
    entry = Entry(bound, {good: Measurement((1.0,)), huge: Measurement((2.0,))},
                  keys.provenance(bound.op))
    data = json.loads(AutotuningResult("cpu", [entry]).dumps())
    data["entries"][0]["configs"][1]["config"]["chunk_q"] = 10**9
    with pytest.raises(SpecError, match="entry 0: .*limit of 1048576"):
        AutotuningResult.loads(json.dumps(data), strict=True)
    data["entries"].append(json.loads(AutotuningResult("cpu", [
        Entry(_layer_norm_bound(), {NullConfig(): Measurement((1.0,))},
              keys.provenance(tk.LayerNorm()))]).dumps())["entries"][0])
    with pytest.warns(BadEntryWarning, match="entry 0: .*limit of 1048576"):
        result = AutotuningResult.loads(json.dumps(data))
    assert [type(e.bound.op).__name__ for e in result.entries] == ["LayerNorm"]


@pytest.mark.parametrize("field, value, match", [
    ("num_warps", None, r"num_warps must be int, got None"),
    ("num_warps", "8", r"num_warps must be int, got '8'"),
    ("num_stages", 2.5, r"num_stages must be int, got 2.5"),
    ("num_stages", True, r"num_stages must be int, got True"),
    ("num_stages", 0, r"num_stages=0 must be at least 1"),
    ("num_warps", -4, r"num_warps=-4 must be at least 1"),
    ("num_warps", 6, r"num_warps=6 must be a power of 2"),
])
def test_a_config_field_of_the_wrong_kind_fails_when_read(field, value, match):
    """A Triton attention config's warp and stage counts were kept whatever they held
    (`null`, `"8"`, `true`, `0`) and reached Triton's compiler."""
    triton_cls = tk.PallasTritonFlashAttention.config_cls
    with pytest.raises((TypeError, ValueError), match=match):
        tk.PallasTritonFlashAttention(config=dataclasses.replace(triton_cls(), **{field: value}))
    fields = {**spec.encode_config(triton_cls()), field: value}
    op = {"dataclass": spec.import_path(tk.PallasTritonFlashAttention),
          "fields": {"config": {"dataclass": spec.import_path(triton_cls), "fields": fields}}}
    with pytest.raises(SpecError, match=match):
        spec.decode(op)
    with pytest.raises((TypeError, ValueError), match=match):
        spec.decode_config(triton_cls, fields)


@pytest.mark.parametrize("edit, why", [
    (lambda arguments: arguments.update(x="f32[2,8,3"), "'f32\\[2,8,3' is not an array spec"),
    (lambda arguments: arguments.update(x="float32[2,8,32]"), "is not an array spec"),
    (lambda arguments: arguments.update(widht=4),
     r"LayerNorm takes no arguments named \['widht'\]"),
])
def test_a_damaged_argument_spec_is_reported_not_kept(edit, why):
    """A hand-edited entry whose array spec is cut short (or misspelled, or an argument the
    op does not take) could never match a call: loading reports it rather than keeping it
    as a string argument."""
    data = _bound_spec()
    edit(data["arguments"])
    with pytest.raises(SpecError, match=why):
        BoundArguments.from_json(json.dumps(data))
    entry = Entry(_layer_norm_bound(), {NullConfig(): Measurement((1.0,))},
                  keys.provenance(tk.LayerNorm()))
    document = json.loads(AutotuningResult("cpu", [entry]).dumps())
    document["entries"].append(json.loads(json.dumps(document["entries"][0])))
    edit(document["entries"][0]["arguments"])
    with pytest.warns(BadEntryWarning, match=f"entry 0: .*{why}"):
        assert len(AutotuningResult.loads(json.dumps(document)).entries) == 1


# --- python -m tokamax_pass ---------------------------------------------------------------------

def test_python_dash_m_runs_the_cli(tmp_path):
    env_path = ":".join(sys.path)
    run = subprocess.run([sys.executable, "-m", "tokamax_pass", "cache", "--cache-dir",
                          str(tmp_path), "list"], capture_output=True, text=True,
                         env={"PYTHONPATH": env_path, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"cache directory: {tmp_path}" in run.stdout and "(empty)" in run.stdout
    run = subprocess.run([sys.executable, "-m", "tokamax_pass", "no-such-command"],
                         capture_output=True, text=True, env={"PYTHONPATH": env_path},
                         timeout=300)
    assert run.returncode == 2 and "invalid choice: 'no-such-command'" in run.stderr
