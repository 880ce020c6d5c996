"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/responses
(all with server-sent-event streaming), /v1/models, vLLM's /tokenize, /detokenize and /version,
/admin/drafts, /health, /metrics, and the published schema (/openapi.json, /docs, served offline)
unless the config turns it off.

`build_app` assembles the pieces: routes (server/routes/), errors (errors.py), the request id and
access log, the body limit and API-key checks (middleware.py), metrics and the optional shadow A/B.
Every error is an OpenAI-style JSON object without a stack trace or a path; a bad request changes
nothing in the engine. A client that disconnects aborts its requests (their blocks are freed).
"""
from __future__ import annotations

from fastapi import FastAPI

from specdec import __version__
from specdec.config import ServerConfig
from specdec.request import RequestOutput
from specdec.server.async_engine import AsyncEngine
from specdec.server.context import ServerContext
from specdec.server.errors import install_error_handlers
from specdec.server.metrics import ServerMetrics
from specdec.server.middleware import BodyLimit, RequestLog
from specdec.server import openapi
from specdec.server.routes import admin, chat, completions, docs, health, models, responses, tokenize
from specdec.server.shadow import PREFIX as SHADOW_PREFIX
from specdec.server.shadow import ShadowAB


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str) -> FastAPI:
    """The app serving `engine` (started by the caller); `model_name` is the reported model id
    unless config.served_model_name is set (then requests may still name either). Raises
    ValueError for a config that cannot be served safely (metrics_require_key without an API key, an
    unreadable keys file)."""
    if config.metrics_require_key and not config.has_keys:
        raise ValueError("server.metrics_require_key is set but no API key is configured (server.api_key, "
                         "api_keys, api_keys_file, --api-key or $SPECDEC_API_KEY): /metrics could not be protected")
    app = FastAPI(title="specdec", version=__version__, description=__doc__.split("\n\n")[0],
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json" if config.openapi else None)
    openapi.install(app)
    served = config.served_model_name or model_name
    metrics = ServerMetrics(engine.stats, served)
    shadow = (ShadowAB(engine, config.shadow_fraction, metrics.source, config.shadow_similarity)
              if config.shadow_fraction > 0 else None)
    _hook(engine, metrics, shadow)
    app.state.specdec = ServerContext(engine, config, metrics, served, tuple({model_name} - {served}))
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, on_reject=metrics.rejected)
    app.add_middleware(RequestLog)  # added last: outermost, so even a 413 carries the request id
    install_error_handlers(app, metrics.rejected, config.retry_after)
    for module in (health, models, tokenize, admin, completions, chat, responses):
        app.include_router(module.router)
    if config.openapi:
        docs.install(app)
    return app


def _hook(engine: AsyncEngine, metrics: ServerMetrics, shadow: ShadowAB | None) -> None:
    """Route the engine thread's events to the metrics and the shadow A/B (shadow copies are not
    client requests: they count only in the shadow's own metrics)."""
    def on_finished(out: RequestOutput) -> None:
        if not out.request_id.startswith(SHADOW_PREFIX):
            metrics.finished(out)
        if shadow is not None:
            shadow.finished(out)

    def on_aborted(request_id: str) -> None:
        metrics.requests.labels("abort").inc()
        if shadow is not None:
            shadow.aborted(request_id)

    engine.on_finished, engine.on_aborted = on_finished, on_aborted
    engine.on_added = shadow.select if shadow is not None else None
