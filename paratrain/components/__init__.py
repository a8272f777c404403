"""Pieces every strategy shares: optimizer helpers, precision, accumulation, activation
checkpointing, meta-device materialisation, contrastive losses and metrics."""
