"""What a client library sent the server and what came back, recorded by httpx event hooks on the
HTTP client the library is handed (openai's own DefaultHttpxClient / DefaultAsyncHttpxClient), so a
failing test of tests/test_clients.py can show the exact exchange."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import openai

MAX_SHOWN = 6000  # characters of one body in a dump


@dataclass
class Exchange:
    method: str
    url: str
    request_body: str
    status: int | None = None
    response_body: str | None = None


def _text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:  # one line of JSON, key order kept, so a dump can be pasted back as a request
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text  # a server-sent event stream, or not JSON at all


@dataclass
class Wire:
    """The exchanges of one test, in order; `http_client()` / `async_http_client()` record into it."""
    exchanges: list[Exchange] = field(default_factory=list)

    def _on_request(self, request) -> None:
        self.exchanges.append(Exchange(request.method, str(request.url), _text(request.content)))

    def _on_response(self, response) -> None:
        # the body is read here, whole (a stream too: the client then iterates what was read)
        exchange = self._exchange_of(response)
        exchange.status, exchange.response_body = response.status_code, _text(response.content)

    def _exchange_of(self, response) -> Exchange:
        for exchange in reversed(self.exchanges):
            if exchange.status is None and exchange.url == str(response.request.url):
                return exchange
        exchange = Exchange(response.request.method, str(response.request.url), "")
        self.exchanges.append(exchange)
        return exchange

    def http_client(self, timeout: float = 600):
        def on_response(response) -> None:
            response.read()
            self._on_response(response)
        return openai.DefaultHttpxClient(timeout=timeout, event_hooks={"request": [self._on_request],
                                                                       "response": [on_response]})

    def async_http_client(self, timeout: float = 600):
        async def on_request(request) -> None:
            self._on_request(request)

        async def on_response(response) -> None:
            await response.aread()
            self._on_response(response)
        return openai.DefaultAsyncHttpxClient(timeout=timeout, event_hooks={"request": [on_request],
                                                                            "response": [on_response]})

    def dump(self) -> str:
        """Every exchange as `>>> METHOD URL body` and `<<< STATUS body` lines."""
        lines = []
        for i, e in enumerate(self.exchanges):
            lines.append(f"[{i}] >>> {e.method} {e.url} {e.request_body[:MAX_SHOWN]}")
            body = e.response_body if e.response_body is not None else "(no response)"
            lines.append(f"[{i}] <<< {e.status} {body[:MAX_SHOWN]}")
        return "\n".join(lines) or "(no HTTP exchange)"
