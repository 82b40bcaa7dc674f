"""Embeddings and reranking: models that pool hidden states into vectors or scores."""
