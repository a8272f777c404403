"""parallel/: every strategy against one process."""
