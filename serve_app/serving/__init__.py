"""Serving a model: a request to prompt tokens, the engine, events back."""
