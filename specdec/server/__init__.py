"""The OpenAI-compatible HTTP server: protocol models, the engine thread, routes, errors,
middleware, metrics and shadow A/B. Reads the engine through its public API and stats snapshot."""
