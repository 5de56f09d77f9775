"""Kept experiments: device scripts, each asking one question (see README.md)."""
