#!/usr/bin/env bash
# Prints the Debian packages `bazel test //...` needs that this machine lacks, one a
# line, each checked by what it provides (a machine may have `bazel` from elsewhere and
# still lack the rules WORKSPACE points at):
#   bazel-bootstrap   the `bazel` binary (Bazel 4.2.3, which the offline WORKSPACE suits)
#   bazel-rules-java  @rules_java, the local repository at /usr/share/bazel/rules/java
set -euo pipefail
command -v bazel >/dev/null 2>&1 || echo bazel-bootstrap
[ -d /usr/share/bazel/rules/java ] || echo bazel-rules-java
