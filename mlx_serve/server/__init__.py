"""The HTTP layer: OpenAI- and Anthropic-compatible routes over an `Engine`. It never imports MLX."""

from mlx_serve.server.app import create_app
from mlx_serve.server.metrics import ServerMetrics

__all__ = ["ServerMetrics", "create_app"]
