"""launch/: `paratrain run` and its ranks."""
