"""What the routes share: one `ServerContext` per app, kept on `app.state` and handed to each
route by the `context` dependency (no module globals: two apps in one process stay apart), and the
gates every generation route passes: the engine is ready, the server admits work (not draining),
the model named is the one served."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from fastapi import Request

from specdec.config import ServerConfig
from specdec.engine import LLMEngine
from specdec.server.async_engine import AsyncEngine
from specdec.server.errors import APIError
from specdec.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics
    served_model: str                     # the model id the API reports
    aliases: tuple[str, ...] = ()         # other names a request may give for it
    draining: bool = False                # shutting down: new work gets 503
    # sha256 of each Authorization header that passes -> its key's id (a digest prefix: logs and cache
    # scopes name keys by it, never by the key); the operator's (api_key) alone opens /admin
    key_ids: dict[bytes, str] = field(init=False)
    admin_auth: bytes | None = field(init=False)

    def __post_init__(self) -> None:
        self.key_ids = {_auth_digest(k): hashlib.sha256(k.encode()).hexdigest()[:12] for k in self.config.all_keys()}
        self.admin_auth = None if self.config.api_key is None else _auth_digest(self.config.api_key)

    def cache_salt(self, key_id: str | None, salt: str | None) -> str | None:
        """The salt a request's caches are scoped by: its own cache_salt, within its API key's scope
        under `cache_scope: api_key`."""
        if self.config.cache_scope != "api_key":
            return salt
        return f"key:{key_id}" if salt is None else f"key:{key_id}\x00{salt}"

    def ready_engine(self) -> LLMEngine:
        """The engine once its models are loaded. Raises APIError 503 before (or if loading failed)."""
        if self.engine.engine is None:
            if self.engine.error is None:
                raise APIError(503, "the models are still loading", code="model_loading", retry=True)
            raise APIError(503, "the engine failed to start")
        return self.engine.engine

    def admit(self, model: str | None) -> LLMEngine:
        """The engine, for a request that may start now and names the served model (or none)."""
        eng = self.ready_engine()
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", retry=True)
        self.check_model(model)
        return eng

    def check_model(self, model: str | None) -> None:
        """Raises the 404 every route gives a model name that is not the served one (None: any)."""
        if model is not None and model != self.served_model and model not in self.aliases:
            raise APIError(404, f"the model {model!r} is not served here (served: {self.served_model!r}); "
                                "drafts are chosen per request with speculative.method", "model", "model_not_found")


def context(request: Request) -> ServerContext:
    """FastAPI dependency: the context of the app serving this request."""
    return request.app.state.specdec


def _auth_digest(key: str) -> bytes:
    return hashlib.sha256(f"Bearer {key}".encode()).digest()
