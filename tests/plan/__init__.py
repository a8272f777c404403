"""plan/: `paratrain plan`."""
