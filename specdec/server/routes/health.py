"""GET /health (503 until the models are loaded, or if loading failed) and GET /metrics
(Prometheus text format). Neither needs the API key."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specdec.server.context import ServerContext, context

router = APIRouter()


@router.get("/health")
async def health(ctx: ServerContext = Depends(context)):
    if ctx.engine.engine is None:
        status = "loading" if ctx.engine.error is None else "failed"
        return JSONResponse({"status": status}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(ctx: ServerContext = Depends(context)):
    body = await asyncio.to_thread(generate_latest, ctx.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
