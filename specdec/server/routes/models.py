"""GET /v1/models: the one model served, with its context length, precision and proposers;
GET /v1/models/{model}: that card, for the served id or an alias the server accepts (else a 404)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from specdec.metrics import EngineStats
from specdec.server.context import ServerContext, context
from specdec.server.middleware import check_auth
from specdec.server.openapi import ModelCard, ModelList, errors, ok

router = APIRouter()


def speculative_card(stats: EngineStats) -> dict:
    """The configured proposer, whether a router picks per request, and every loaded proposer by id."""
    spec = stats.speculation
    if spec is None:
        return {"default": None, "router": False, "proposers": {}}
    return {"default": spec.default, "router": spec.router is not None,
            "proposers": {p.id: p.name for p in spec.proposers}}


@router.get("/v1/models", dependencies=[Depends(check_auth)], responses={**ok(ModelList), **errors(401, 503)})
async def models(ctx: ServerContext = Depends(context)):
    return {"object": "list", "data": [await _card(ctx)]}


# `:path`: a served name may hold slashes ("org/model"), which clients send as they are
@router.get("/v1/models/{model:path}", dependencies=[Depends(check_auth)],
            responses={**ok(ModelCard), **errors(401, 404, 503)})
async def model(model: str, ctx: ServerContext = Depends(context)):
    ctx.check_model(model)
    return await _card(ctx)


async def _card(ctx: ServerContext) -> dict:
    ctx.ready_engine()
    stats = await ctx.engine.snapshot()
    return {"id": ctx.served_model, "object": "model", "created": int(time.time()), "owned_by": "specdec",
            "max_model_len": stats.max_model_len, "precision": stats.precision,
            "speculative": speculative_card(stats)}
