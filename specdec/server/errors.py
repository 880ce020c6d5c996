"""OpenAI-style errors: `APIError` for the handlers to raise, the JSON body every error response
carries, and the exception handlers that turn exceptions into those bodies.

No body carries a stack trace or a path. Every 4xx except 503 (still loading) counts in
`specdec_requests_total{status="rejected_<code>"}`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("specdec.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client as is: HTTP `status`, and the OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def install_error_handlers(app: FastAPI, on_reject: Callable[[int], None]) -> None:
    """Answer APIError, validation errors, HTTP errors and anything unexpected (500) with an error
    body; `on_reject(status)` counts the rejections."""

    def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if status >= 400 and status != 503:
            on_reject(status)
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, "request body is not valid JSON")
        msg = str(first.get("msg", "invalid request"))
        return error(400, f"{'.'.join(loc) or 'body'}: {msg}", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(500, "internal server error"), status_code=500)
