"""What every pdserve gRPC server shares: standard services and one exception -> status mapping.

add_standard_services(server, names)            grpc.health.v1 health + server reflection (sync server)
await add_standard_services_aio(server, names)  the same for a grpc.aio server
status_for(exc)                                 the status code an exception maps to
ExceptionToStatusInterceptor / AioExceptionToStatusInterceptor
                                                apply status_for to every handler of a server
map_exceptions                                  the same as a decorator, for one servicer method

Mapping (first match wins): StatusError subclasses carry their own code (UnavailableError ->
UNAVAILABLE); a grpc.RpcError from a downstream call keeps its code; TimeoutError ->
DEADLINE_EXCEEDED; ConnectionError -> UNAVAILABLE; ValueError -> INVALID_ARGUMENT; KeyError and
other LookupErrors (an unknown request or model) -> NOT_FOUND, except IndexError, which is a bug;
NotImplementedError -> UNIMPLEMENTED; anything else -> INTERNAL, logged with its traceback. The
status details are the exception's message. A handler that already aborted (context.abort) or set
a code keeps its own status.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

__all__ = [
    "AioExceptionToStatusInterceptor",
    "ExceptionToStatusInterceptor",
    "StatusError",
    "UnavailableError",
    "add_standard_services",
    "add_standard_services_aio",
    "map_exceptions",
    "status_details",
    "status_for",
]


class StatusError(Exception):
    """An error that names its gRPC status code; subclass it and set ``code``."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class UnavailableError(StatusError):
    """The server cannot take the request now (no node, shutting down); the client may retry."""

    code = grpc.StatusCode.UNAVAILABLE


# ---- standard services -------------------------------------------------------------------------


def _reflection_names(service_names: Sequence[str]) -> list[str]:
    return [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]


def _health_status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


def add_standard_services(
    server: grpc.Server, service_names: Sequence[str], *, serving: bool = True
) -> health.HealthServicer:
    """Register grpc.health.v1 and server reflection on a (sync) ``server``.

    service_names: full names of the services the server implements (e.g.
    ``generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name``); each gets a health
    status, as does the whole server (""). serving: the initial status; a node that loads its
    model after starting passes False and calls ``set(name, SERVING)`` when ready. Returns the
    health servicer; call its ``enter_graceful_shutdown()`` before ``server.stop(grace)``.
    """
    if isinstance(server, grpc.aio.Server):
        raise TypeError("a grpc.aio.Server takes `await add_standard_services_aio(server, names)`")
    servicer = health.HealthServicer()
    for name in ("", *service_names):
        servicer.set(name, _health_status(serving))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(_reflection_names(service_names), server)
    return servicer


async def add_standard_services_aio(
    server: grpc.aio.Server, service_names: Sequence[str], *, serving: bool = True
) -> health.aio.HealthServicer:
    """add_standard_services for a grpc.aio server (its health servicer's methods are async)."""
    servicer = health.aio.HealthServicer()
    for name in ("", *service_names):
        await servicer.set(name, _health_status(serving))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(_reflection_names(service_names), server)
    return servicer


# ---- exceptions -> status codes ----------------------------------------------------------------


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a handler's exception maps to (see the module docstring)."""
    if isinstance(exc, StatusError):
        return exc.code
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        code = exc.code()
        if isinstance(code, grpc.StatusCode):
            return code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, ConnectionError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, LookupError) and not isinstance(exc, IndexError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


def status_details(exc: BaseException) -> str:
    """The status details for ``exc``: its message (KeyError's without the quotes repr adds)."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "details", None)):
        details = exc.details()
        if details:
            return str(details)
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    else:
        text = str(exc)
    if status_for(exc) == grpc.StatusCode.INTERNAL:
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text or type(exc).__name__


def _already_aborted(exc: BaseException, context: Any) -> bool:
    """True when the handler set its own status (context.abort raises a bare Exception in sync gRPC)."""
    if isinstance(exc, grpc.aio.AbortError):
        return True
    code = getattr(context, "code", None)
    try:
        return callable(code) and code() is not None
    except Exception:  # a context without a readable code (test doubles)
        return False


def _report(exc: Exception) -> tuple[grpc.StatusCode, str]:
    code, details = status_for(exc), status_details(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("handler failed: %s", details, exc_info=exc)
    else:
        logger.info("handler answered %s: %s", code.name, details)
    return code, details


def map_exceptions(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a servicer method (sync, generator, coroutine or async generator) so that an exception
    ends the call with ``status_for(exc)`` and its message. The context is the last argument."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def agen_wrapper(*args: Any) -> Any:
            try:
                async for item in fn(*args):
                    yield item
            except Exception as exc:
                if _already_aborted(exc, args[-1]):
                    raise
                await args[-1].abort(*_report(exc))

        return agen_wrapper
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def coro_wrapper(*args: Any) -> Any:
            try:
                return await fn(*args)
            except Exception as exc:
                if _already_aborted(exc, args[-1]):
                    raise
                await args[-1].abort(*_report(exc))

        return coro_wrapper
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: Any) -> Any:
            try:
                yield from fn(*args)
            except Exception as exc:
                if _already_aborted(exc, args[-1]):
                    raise
                args[-1].abort(*_report(exc))

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            if _already_aborted(exc, args[-1]):
                raise
            args[-1].abort(*_report(exc))

    return wrapper


def _streamed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function returning an iterator, made a generator so map_exceptions covers iteration."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn) or inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    def gen(*args: Any) -> Any:
        yield from fn(*args)

    return gen


_FACTORIES = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _wrap_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None
    attr, factory = _FACTORIES[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behavior = getattr(handler, attr)
    if handler.response_streaming:
        behavior = _streamed(behavior)
    return factory(
        map_exceptions(behavior),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ExceptionToStatusInterceptor(grpc.ServerInterceptor):
    """Server interceptor (sync servers) applying ``map_exceptions`` to every handler."""

    def intercept_service(self, continuation, handler_call_details):
        return _wrap_handler(continuation(handler_call_details))


class AioExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    """Server interceptor (grpc.aio servers) applying ``map_exceptions`` to every handler."""

    async def intercept_service(self, continuation, handler_call_details):
        return _wrap_handler(await continuation(handler_call_details))
