"""Kept experiments: device scripts, one line of purpose each."""
