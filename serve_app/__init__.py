"""serve_app: MLX / mlx-lm models on Ray Serve, OpenAI- and Anthropic-compatible."""

__version__ = "0.4.0"
