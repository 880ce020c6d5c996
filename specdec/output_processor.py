"""OutputProcessor: token ids -> text, stop conditions, and RequestOutputs.

Knows nothing about models. Text is detokenized incrementally (UTF-8 safe); a stop string cuts the
text exactly where it starts; a streaming delta never shows a tail that could still become a stop
string.
"""
from __future__ import annotations

from specdec.models.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.request import Request, RequestOutput, RequestStats, RequestStatus


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}
        self._text_end: dict[str, int] = {}  # where a stop string cut the text

    def add(self, req: Request) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        self._emitted[req.request_id] = 0

    def free(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._emitted.pop(request_id, None)
        self._text_end.pop(request_id, None)

    def check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Called after each appended token; returns the finished status if the request must stop here."""
        p = req.params
        detok = self._detok[req.request_id]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        before = len(detok.text)
        detok.add([token])
        if p.stop:
            text = detok.text
            start = max(0, before - (max(map(len, p.stop)) - 1))
            hits = [(pos, s) for s in p.stop if (pos := text.find(s, start)) >= 0]
            if hits:
                pos, s = min(hits)
                self._text_end[req.request_id] = pos
                req.stop_reason = s
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def output(self, req: Request, stats: RequestStats) -> RequestOutput:
        rid = req.request_id
        text = self._detok[rid].text[: self._text_end.get(rid)]
        visible = len(text) if req.finished else len(text) - stop_prefix_len(text, req.params.stop)
        start = self._emitted[rid]
        delta = text[start:visible] if visible > start else ""
        self._emitted[rid] = max(start, visible)
        return RequestOutput(
            request_id=rid, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), text=text[: max(start, visible)], finished=req.finished,
            finish_reason=req.status.value if req.finished else None, stats=stats,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None, delta_text=delta,
            error=req.grammar.error if req.finished and req.grammar is not None else None)


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
