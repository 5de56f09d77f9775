"""Example models used by the docs, the Bazel rule and the tests."""
