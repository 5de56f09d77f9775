"""Runs pytest on the test files named in argv, from the workspace root in the runfiles."""

import os
import sys

import pytest

if __name__ == "__main__":
    workspace = os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"])
    os.chdir(workspace)
    sys.path.insert(0, os.path.join(workspace, "tests"))  # the suite imports its conftest helpers
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
