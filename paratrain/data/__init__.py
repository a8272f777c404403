"""What each rank reads: the distributed sampler, the session's loader, and batches."""
