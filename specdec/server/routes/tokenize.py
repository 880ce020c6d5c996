"""vLLM's POST /tokenize, POST /detokenize and GET /version, with its request and response shapes.

/tokenize takes a `prompt` (vLLM's TokenizeCompletionRequest) or chat `messages` (its
TokenizeChatRequest: templated as /v1/chat/completions templates them, tools included) and answers
{count, max_model_len, tokens, token_strs}; /detokenize takes {tokens} and answers {prompt}. Both
need the API key and refuse a model name that is not served (404), as the /v1 routes do; /version
is open, as /health is."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from specdec import __version__
from specdec.server.context import ServerContext, context
from specdec.server.errors import APIError
from specdec.server.middleware import check_auth
from specdec.server.openapi import Detokenized, Tokenized, Version, errors, ok
from specdec.server.protocol import DetokenizeRequest, TokenizeRequest
from specdec.server.routes.chat import chat_prompt_ids
from specdec.server.tools import check_tools

router = APIRouter()


def _ids(ctx: ServerContext, body: TokenizeRequest) -> list[int]:
    """The token ids of the prompt, or of the templated conversation."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
        if body.tools is not None:
            raise APIError(400, "tools go with messages, not a prompt", "tools")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        try:
            return ctx.ready_engine().tokenizer.encode(body.prompt, add_special_tokens=special)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
    tools = None
    if body.tools:
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        try:
            check_tools(tools)
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
    return chat_prompt_ids(ctx, body.messages, tools, body.add_generation_prompt, bool(body.add_special_tokens))


@router.post("/tokenize", dependencies=[Depends(check_auth)],
             responses={**ok(Tokenized), **errors(400, 401, 404, 413, 503)})
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(context)):
    eng = ctx.ready_engine()
    ctx.check_model(body.model)
    ids = _ids(ctx, body)
    strs = [eng.tokenizer.token_strings[i] for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", dependencies=[Depends(check_auth)],
             responses={**ok(Detokenized), **errors(400, 401, 404, 413, 503)})
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(context)):
    tok = ctx.ready_engine().tokenizer
    ctx.check_model(body.model)
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"tokens: ids outside the vocabulary (0..{tok.vocab_size - 1}): {bad[:5]}", "tokens")
    return {"prompt": tok.decode(body.tokens)}


@router.get("/version", responses=ok(Version))
async def version():
    return {"version": __version__}
