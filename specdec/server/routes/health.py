"""GET /health (503 until the models are loaded, if loading failed, or while draining for a
shutdown) and GET /metrics (Prometheus text format). Neither needs the API key, unless
server.metrics_require_key puts /metrics behind it."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specdec.server.context import ServerContext, context
from specdec.server.middleware import check_metrics_auth
from specdec.server.openapi import Health, errors, ok

router = APIRouter()
_HEALTH = {**ok(Health), 503: {"model": Health, "description": "loading, failed or draining"}}


@router.get("/health", responses=_HEALTH)
async def health(ctx: ServerContext = Depends(context)):
    if ctx.engine.engine is None:
        status = "loading" if ctx.engine.error is None else "failed"
        return JSONResponse({"status": status}, status_code=503)
    if ctx.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


# load balancers probe with HEAD: the same answer without a body
router.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head", responses=_HEALTH)


@router.get("/metrics", dependencies=[Depends(check_metrics_auth)],
            responses={**ok(None, media=CONTENT_TYPE_LATEST.split(";")[0]), **errors(401)})
async def prometheus(ctx: ServerContext = Depends(context)):
    body = await asyncio.to_thread(generate_latest, ctx.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
