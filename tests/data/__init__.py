"""data/: the sampler and the session's loader."""
