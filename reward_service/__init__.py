"""SplitRL reward service."""
