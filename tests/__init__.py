"""The tests. Each folder mirrors a package of paratrain; tests/support holds the helpers."""
