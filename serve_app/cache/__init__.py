"""The prefix KV cache: block identity, layer layouts, payloads, the hot tier."""
