"""A quantized K/V cache that continuous batching can run: the format, the caches."""
