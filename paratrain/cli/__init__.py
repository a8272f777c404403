"""The `paratrain` command, one module per subcommand (main.py dispatches; argparse only)."""
