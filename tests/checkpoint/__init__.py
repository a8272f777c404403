"""checkpoint/: saves, loads, resharding, safety."""
