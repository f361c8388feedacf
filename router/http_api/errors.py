"""HTTP errors in OpenAI's JSON shape, and the one mapping from exceptions to them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

An exception becomes a status through the same table the gRPC servers use
(`pdserve_api.servers.status_for`), then the gRPC code becomes an HTTP status: INVALID_ARGUMENT 400,
NOT_FOUND 404, ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504,
UNIMPLEMENTED 501, anything else 500 (logged with its traceback). A 429 (a full queue,
pdserve.serving.admission.ResourceExhaustedError, or a downstream RESOURCE_EXHAUSTED) carries a
`Retry-After` header in whole seconds.
"""

from __future__ import annotations

import json
import logging

import grpc
from aiohttp import web

from pdserve.serving.admission import ResourceExhaustedError
from pdserve_api.servers import status_details, status_for

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
         408: "timeout",
         409: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error", 499: "cancelled", 501: "not_implemented", 503: "service_unavailable",
         504: "timeout"}


class ApiError(Exception):
    """An HTTP error to answer: status, message, and OpenAI's `param` (the offending field) and `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPE.get(self.status, "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_exception(exc: BaseException) -> ApiError:
    """The ApiError an exception raised while serving a request stands for."""
    if isinstance(exc, ApiError):
        return exc
    code = status_for(exc)
    status = _HTTP_STATUS.get(code, 500)
    message = status_details(exc)
    if status == 500:
        logger.error("request failed: %s: %s", code.name, message, exc_info=exc)
    if status == 404 and "model" in message:
        return ApiError(404, message, param="model", code="model_not_found")
    if status == 400 and "plus max_tokens=" in message:  # a node's context check (serving.convert.context_error)
        return ApiError(400, message, param="max_tokens")
    if status == 429:
        retry = exc.retry_after_header if isinstance(exc, ResourceExhaustedError) else "1"
        return ApiError(429, message, headers={"Retry-After": retry})
    return ApiError(status, message)
