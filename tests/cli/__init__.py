"""cli/: the commands."""
