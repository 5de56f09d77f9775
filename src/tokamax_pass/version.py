"""The library version, in a module of its own so that any module can read it without
importing the package (whose `__init__` imports the framework)."""

__version__ = "0.1.0"
# The version as a tuple of ints, `(major, minor, patch)`, as upstream Tokamax exports it.
__version_info__ = tuple(int(part) for part in __version__.split("."))
# Upstream Tokamax's `__git_revision__` names the commit a release wheel was built from and
# is empty in a source checkout; no build here stamps one, so it is empty.
__git_revision__ = ""
