"""parallel/pipeline/: the pipeline."""
