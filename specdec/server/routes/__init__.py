"""The HTTP routes, one module per group; `build_app` (server/app.py) includes each `router`."""
