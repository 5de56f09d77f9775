"""Bazel rules for tokamax_pass: tuned StableHLO artifacts built at build time."""

def _tokamax_stablehlo_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    args = ctx.actions.args()
    args.add_all(["-m", "tokamax_pass.cli", "export", ctx.attr.function])
    args.add("--args")
    args.add_all(ctx.attr.arg_specs)
    if ctx.file.results:
        args.add("--results", ctx.file.results.path)
    if ctx.attr.platforms:
        args.add("--platforms", ",".join(ctx.attr.platforms))
    if ctx.attr.device_kind:
        args.add("--device-kind", ctx.attr.device_kind)
    args.add("-o", out.path)
    # The library itself: a source or shipped-cache change rebuilds the artifact (the
    # action imports the workspace's package, which Bazel would not otherwise track).
    inputs = list(ctx.files.srcs) + list(ctx.files._library)
    if ctx.file.results:
        inputs.append(ctx.file.results)
    ctx.actions.run(
        executable = ctx.executable._python,
        arguments = [args],
        inputs = inputs,
        outputs = [out],
        env = {"PYTHONPATH": ".", "JAX_PLATFORMS": "cpu"},
        mnemonic = "TokamaxStablehlo",
        progress_message = "Exporting tuned StableHLO for %s" % ctx.attr.function,
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

tokamax_stablehlo = rule(
    implementation = _tokamax_stablehlo_impl,
    doc = """Exports `function` (MODULE:FUNCTION) for `arg_specs` as a tuned artifact directory
    (serialized jax.export.Exported + manifest.json), with configs from `results` (an
    AutotuningResult JSON) and one kernel per platform in `platforms`.""",
    attrs = {
        "function": attr.string(mandatory = True, doc = "MODULE:FUNCTION, importable from srcs"),
        "arg_specs": attr.string_list(mandatory = True, doc = "Array specs, e.g. 'bf16[8,128]'"),
        "srcs": attr.label_list(allow_files = [".py"], doc = "Python files the function needs"),
        "results": attr.label(allow_single_file = [".json"], doc = "AutotuningResult JSON"),
        "platforms": attr.string_list(doc = "Export platforms, e.g. ['cpu', 'cuda', 'tpu']"),
        "device_kind": attr.string(
            doc = "Target device(s) when exporting from a machine without them, one per " +
                  "platform, comma-separated: 'NVIDIA H200' or 'NVIDIA H200,TPU v6 lite'",
        ),
        "_library": attr.label_list(default = ["//:sources"], allow_files = True),
        "_python": attr.label(
            default = "//bazel:python3.sh",
            executable = True,
            allow_single_file = True,
            cfg = "exec",
        ),
    },
)

def tokamax_pytest(name, tests, data = [], size = "small", **kwargs):
    """A py_test that runs pytest on `tests` (files under tests/) from the workspace root."""
    native.py_test(
        name = name,
        srcs = ["//bazel:pytest_runner.py"],
        main = "//bazel:pytest_runner.py",
        args = tests,
        data = ["//:sources"] + tests + data,
        python_version = "PY3",
        size = size,
        **kwargs
    )
