"""From a validated request body to engine requests: prompt checks against the context length,
sampling parameters and speculative options (a bad value is a 400), the server's token caps
(max_tokens_limit, max_request_tokens: 400), and submission (a full queue is a 429). A request
refused here changes nothing in the engine."""
from __future__ import annotations

import asyncio

from specdec.engine import QueueFull
from specdec.request import SpecOptions
from specdec.sample.structured import GrammarBusy
from specdec.sampling_params import SamplingParams, StructuredOutput
from specdec.server.async_engine import RequestStream
from specdec.server.context import ServerContext
from specdec.server.errors import APIError
from specdec.server.streaming import close_all

Job = tuple[list[int], SamplingParams]


def prepare(ctx: ServerContext, prompt: str | list[int], max_tokens: int | None, param: str
            ) -> tuple[list[int], int]:
    """(token ids, max_tokens) of a prompt; max_tokens None: whatever room the context leaves, up to
    the server's max_tokens_limit."""
    eng = ctx.ready_engine()
    tok = eng.tokenizer
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt is empty", param)
        ids = tok.encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary (0..{tok.vocab_size - 1}): {bad[:5]}", param)
    if not ids:
        raise APIError(400, "prompt is empty", param)
    room = eng.max_model_len - len(ids)
    if room < 1:
        raise APIError(400, f"prompt has {len(ids)} tokens; the context holds {eng.max_model_len}", param)
    limit = ctx.config.max_tokens_limit
    if max_tokens is None:
        max_tokens = room if limit is None else min(room, limit)
    elif limit is not None and max_tokens > limit:
        raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's max_tokens_limit ({limit})",
                       "max_tokens")
    elif len(ids) + max_tokens > eng.max_model_len:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                            f"({eng.max_model_len} tokens)", "max_tokens")
    return ids, max_tokens


def check_budget(ctx: ServerContext, jobs: list[Job]) -> None:
    """The request's worst case (prompt + max_tokens over every choice) within max_request_tokens."""
    cap = ctx.config.max_request_tokens
    total = sum(len(ids) + params.max_tokens for ids, params in jobs)
    if cap is not None and total > cap:
        raise APIError(400, f"this request may use up to {total} tokens (prompt + max_tokens, every choice); "
                            f"this server's max_request_tokens is {cap}", "max_tokens")


async def start(ctx: ServerContext, jobs: list[Job], spec: SpecOptions | None) -> list[RequestStream]:
    """Submit every job, or none: on a refusal the ones already queued are aborted."""
    check_budget(ctx, jobs)
    streams: list[RequestStream] = []
    try:
        for ids, params in jobs:
            streams.append(await ctx.engine.submit(ids, params, spec))
    except QueueFull as e:
        close_all(streams, "another choice of its request was refused")
        raise APIError(429, str(e), code="queue_full", retry=True) from None
    except ValueError as e:
        close_all(streams, "another choice of its request was refused")
        raise APIError(400, str(e)) from None
    except BaseException:
        close_all(streams, "cancelled while queueing")
        raise
    return streams


def request_seed(ctx: ServerContext, body) -> int:
    """The seed every choice of the request shares: its own, else one the engine draws (answered in
    the response's `speculative.seed`, so that the request can be replayed)."""
    return body.seed if body.seed is not None else ctx.ready_engine().draw_seed()


def sampling(body, max_tokens: int, logprobs: int | None, j: int, seed: int,
             structured: StructuredOutput | None = None, cache_salt: str | None = None) -> SamplingParams:
    """The sampling parameters of choice j (noise keyed by (seed, j)), in the caches' scope `cache_salt`
    (ServerContext.cache_salt)."""
    try:
        return body.sampling_params(max_tokens, logprobs, seed=seed, choice=j, structured=structured,
                                    cache_salt=cache_salt)
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def compile_structured(ctx: ServerContext, structured: StructuredOutput, param: str) -> StructuredOutput:
    """Check a constraint against the model's tokenizer before anything is queued: an invalid schema,
    regex or grammar, or one over a structured_outputs bound, is a 400 naming the field and the bound
    (compiled off the event loop, on the compiler's own thread: a slow compile holds no server
    thread, and its answer comes within compile_timeout_s)."""
    try:
        compiling = await asyncio.to_thread(ctx.ready_engine().grammars.compile_async, structured)
        await asyncio.wrap_future(compiling)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param) from None
    except GrammarBusy as e:
        raise APIError(503, str(e), code="grammar_busy", retry=True) from None
    return structured


async def requested_structure(ctx: ServerContext, body) -> StructuredOutput | None:
    """The request's response_format / guided_* constraint, checked; None: unconstrained."""
    try:
        found = body.structured()
    except ValueError as e:
        raise APIError(400, str(e), "response_format") from None
    return None if found is None else await compile_structured(ctx, *found)


def spec_options(body) -> SpecOptions | None:
    if body.speculative is None:
        return None
    try:
        return body.speculative.options()
    except ValueError as e:
        raise APIError(400, str(e), "speculative") from None


def check_request(ctx: ServerContext, body) -> None:
    """The fields checked against the server and its model: n, stop token ids, logit_bias's ids."""
    if body.n > ctx.config.max_n:
        raise APIError(400, f"n must be <= {ctx.config.max_n}", "n")
    vocab = ctx.ready_engine().tokenizer.vocab_size
    for field, ids in (("stop_token_ids", body.stop_token_ids), ("logit_bias", list(body.bias_by_id() or ()))):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{field}: token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", field)
