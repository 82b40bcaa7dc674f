"""The cache store: the per-node Ray actor that owns hot pages and the SSD tier, and its client."""
