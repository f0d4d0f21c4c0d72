"""SplitRL sampler service."""
