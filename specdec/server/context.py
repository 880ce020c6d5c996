"""What the routes share: one `ServerContext` per app, kept on `app.state` and handed to each
route by the `context` dependency (no module globals: two apps in one process stay apart)."""
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
    expected_auth: bytes = field(init=False)  # sha256 of the Authorization header that passes

    def __post_init__(self) -> None:
        self.expected_auth = hashlib.sha256(f"Bearer {self.config.api_key}".encode()).digest()

    def ready_engine(self) -> LLMEngine:
        """The engine once its models are loaded. Raises APIError 503 before (or if loading failed)."""
        if self.engine.engine is None:
            raise APIError(503, "the models are still loading" if self.engine.error is None
                           else "the engine failed to start")
        return self.engine.engine


def context(request: Request) -> ServerContext:
    """FastAPI dependency: the context of the app serving this request."""
    return request.app.state.specdec
