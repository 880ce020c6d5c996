"""GET / POST /admin/drafts: list the drafts, load one in the background (202) or unload one (200).
Needs the server's API key; without one the routes answer 403. A registry model that was never
pulled is a 400 naming `specdec models pull NAME`: the server installs nothing."""
from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from specdec.engine import LLMEngine
from specdec.models.loader import check_pulled
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import check_admin
from specdec.server.openapi import errors
from specdec.server.protocol import AdminDraftRequest

router = APIRouter()


def drafts_report(eng: LLMEngine) -> dict:
    """The configured proposer, the router's state (None: no router) and every draft's status."""
    spec = eng.stats().speculation
    return {"default": spec.default if spec else None, "router": spec.router if spec else None,
            "drafts": [dataclasses.asdict(d) for d in eng.draft_status()]}


@router.get("/admin/drafts", dependencies=[Depends(check_admin)], responses=errors(401, 403, 503))
async def list_drafts(ctx: ServerContext = Depends(context)):
    ctx.ready_engine()
    return await ctx.engine.call(drafts_report)


@router.post("/admin/drafts", dependencies=[Depends(check_admin)],
             responses={202: {"description": "load started"}, **errors(400, 401, 403, 413, 503)})
async def change_drafts(body: AdminDraftRequest, ctx: ServerContext = Depends(context)):
    ctx.ready_engine()

    def act(eng: LLMEngine) -> dict:
        if body.action == "load":
            check_pulled(body.model)  # refused here, as a 400, never installed nor failed in the background
            draft = eng.load_draft(body.model)
        else:
            draft = eng.unload_draft(body.model)
        return {"action": body.action, "id": draft, **drafts_report(eng)}
    try:
        result = await ctx.engine.call(act)
    except ValueError as e:
        raise APIError(400, str(e), "model") from None
    return JSONResponse(result, status_code=202 if body.action == "load" else 200)
