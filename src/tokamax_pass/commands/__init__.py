"""Subcommands of the `tokamax-pass` command line."""
