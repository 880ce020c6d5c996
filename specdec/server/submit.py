"""From a validated request body to engine requests: prompt checks against the context length,
sampling parameters and speculative options (a bad value is a 400), and submission (a full queue
is a 429). A request refused here changes nothing in the engine."""
from __future__ import annotations

from collections.abc import AsyncIterator

from specdec.engine import QueueFull
from specdec.request import RequestOutput, SpecOptions
from specdec.sampling_params import SamplingParams
from specdec.server.context import ServerContext
from specdec.server.errors import APIError
from specdec.server.streaming import close_all

Job = tuple[list[int], SamplingParams]


def prepare(ctx: ServerContext, prompt: str | list[int], max_tokens: int | None, param: str
            ) -> tuple[list[int], int]:
    """(token ids, max_tokens) of a prompt; max_tokens None: whatever room the context leaves."""
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
    if max_tokens is None:
        max_tokens = room
    elif len(ids) + max_tokens > eng.max_model_len:
        raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                            f"({eng.max_model_len} tokens)", "max_tokens")
    return ids, max_tokens


async def start(ctx: ServerContext, jobs: list[Job], spec: SpecOptions | None) -> list[AsyncIterator[RequestOutput]]:
    """Submit every job, or none: on a refusal the ones already queued are aborted."""
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for ids, params in jobs:
            streams.append(await ctx.engine.submit(ids, params, spec))
    except QueueFull as e:
        await close_all(streams)
        raise APIError(429, str(e), code="queue_full") from None
    except ValueError as e:
        await close_all(streams)
        raise APIError(400, str(e)) from None
    except BaseException:
        await close_all(streams)
        raise
    return streams


def sampling(body, max_tokens: int, logprobs: int | None, j: int) -> SamplingParams:
    """The sampling parameters of choice j (its seed offset by j)."""
    try:
        return body.sampling_params(max_tokens, logprobs, seed_offset=j)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def spec_options(body) -> SpecOptions | None:
    if body.speculative is None:
        return None
    try:
        return body.speculative.options()
    except ValueError as e:
        raise APIError(400, str(e), "speculative") from None


def check_n(ctx: ServerContext, body) -> None:
    if body.n > ctx.config.max_n:
        raise APIError(400, f"n must be <= {ctx.config.max_n}", "n")
