"""distributed/: topology, grid, collectives."""
