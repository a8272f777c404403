"""One file per parallelism strategy."""
