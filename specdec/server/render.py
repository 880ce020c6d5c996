"""Response pieces shared by the completion routes: usage (with the proposers that drafted), the
speculative summary, and logprobs in the completions and chat formats."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec.request import RequestOutput


class Decoder(Protocol):
    """What rendering needs of the engine's tokenizer."""
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Sub:
    """One engine request behind a response: which prompt and which of its n choices."""
    index: int
    prompt_index: int
    prompt_tokens: int
    prompt_text: str


def usage_of(subs: list[Sub], outs: list[RequestOutput]) -> dict:
    prompt = sum({s.prompt_index: s.prompt_tokens for s in subs}.values())  # once per prompt, whatever n
    completion = sum(len(o.token_ids) for o in outs)
    cached = sum({s.prompt_index: o.stats.cached_prompt_tokens for s, o in zip(subs, outs)}.values())
    # extension fields: which proposer(s) drafted (none: plain decoding)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "proposer": outs[0].stats.proposer if outs else None, "proposers_used": _proposers_used(outs)}


def _proposers_used(outs: list[RequestOutput]) -> list[str]:
    return list(dict.fromkeys(name for o in outs for name in o.stats.proposers_used))


def spec_summary(outs: list[RequestOutput]) -> dict:
    drafted = sum(o.stats.drafted_tokens for o in outs)
    accepted = sum(o.stats.accepted_tokens for o in outs)
    tokens = sum(o.stats.generated_tokens for o in outs) or 1
    mal = sum(o.stats.mean_accepted_length * o.stats.generated_tokens for o in outs) / tokens
    return {"proposer": outs[0].stats.proposer if outs else None, "method": outs[0].stats.method if outs else "none",
            "proposers_used": _proposers_used(outs),
            "domain": outs[0].stats.domain if outs else None,
            "seed": outs[0].stats.seed if outs else None,   # every choice's: replays the request
            "coupling": outs[0].stats.coupling if outs else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None, "mean_accepted_length": mal,
            "free_drafted_tokens": sum(o.stats.free_drafted_tokens for o in outs),
            "free_accepted_tokens": sum(o.stats.free_accepted_tokens for o in outs),
            "forced_drafted_tokens": sum(o.stats.forced_drafted_tokens for o in outs),
            "forced_accepted_tokens": sum(o.stats.forced_accepted_tokens for o in outs)}


def completion_logprobs(tok: Decoder, out: RequestOutput) -> dict | None:
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, lp in zip(out.token_ids, out.logprobs):
        piece = tok.decode([tid])
        tokens.append(piece)
        token_lps.append(lp.get(tid))
        tops.append({tok.decode([i]): v for i, v in sorted(lp.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok: Decoder, out: RequestOutput) -> dict | None:
    if out.logprobs is None:
        return None
    content = []
    for tid, lp in zip(out.token_ids, out.logprobs):
        piece = tok.decode([tid])
        top = [{"token": tok.decode([i]), "logprob": v, "bytes": list(tok.decode([i]).encode())}
               for i, v in sorted(lp.items(), key=lambda kv: -kv[1])]
        content.append({"token": piece, "logprob": lp.get(tid), "bytes": list(piece.encode()), "top_logprobs": top})
    return {"content": content}
