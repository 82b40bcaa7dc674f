"""Metrics: the one table, recording them through Ray, the samples of each component."""
