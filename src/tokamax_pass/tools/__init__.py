"""Command-line tools that work on artifacts of a run (profiles)."""
