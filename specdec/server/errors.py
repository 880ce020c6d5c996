"""OpenAI-style errors: `APIError` for the handlers to raise, the JSON body every error response
carries, and the exception handlers that turn exceptions into those bodies.

No body carries a stack trace or a path. Every 4xx and 503 except "still loading" counts in
`specdec_requests_total{status="rejected_<code>"}`. An answer that says "try again later" (429, 503
while draining or overloaded) carries `Retry-After`; a 405 carries `Allow`. A client that went away
gets nothing and logs nothing above INFO.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specdec.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the access log shows it


class APIError(Exception):
    """An error answered to the client as is: HTTP `status`, and the OpenAI error fields; `retry`
    adds Retry-After (the server's configured delay)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry = status, message, param, code, retry


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready (its requests are aborted)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def install_error_handlers(app: FastAPI, on_reject: Callable[[int], None], retry_after: int) -> None:
    """Answer APIError, validation errors, HTTP errors and anything unexpected (500) with an error
    body; `on_reject(status)` counts the rejections."""

    def error(status: int, message: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        if status >= 400 and code != "model_loading":
            on_reject(status)
        return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error(e.status, e.message, e.param, e.code, {"Retry-After": str(retry_after)} if e.retry else None)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, e: ClientDisconnected):
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, "request body is not valid JSON")
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            msg = "unrecognized field: this server does not implement it"
        return error(400, f"{'.'.join(loc) or 'body'}: {msg}", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("internal error")
        # answered outside the middleware stack: the request id header is added here
        record = request.scope.get("state", {}).get("access")
        headers = {"x-request-id": record.request_id} if record is not None else None
        return JSONResponse(error_body(500, "internal server error"), status_code=500, headers=headers)
