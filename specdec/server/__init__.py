"""The OpenAI-compatible HTTP server: protocol models, the engine thread, metrics, routes."""
