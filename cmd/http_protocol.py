"""HTTP/1.1 for ``llama-chat serve``: uvicorn's h11 protocol with a read timeout for a request's
headers, and its refusals of what is not HTTP answered as the API's JSON errors.

uvicorn closes a connection that stays silent after a response, but not one that is silent from
its start, and a client that sends its headers a byte at a time (slowloris) holds its connection
for as long as it likes. Here a request's line and headers must all arrive within
``header_timeout_s`` of the connection opening or of the request's first byte; past it the client
gets 408 (or, having sent nothing, just the close) and the connection closes. (The body has its
own limit, in ``serve_app._read_json``.)

What h11 refuses before a request exists (headers or a request line past its buffer, a bad
Content-Length, bytes that are not HTTP) uvicorn answers with a plain-text 400; here it is an
OpenAI error object, with 431 for headers too large and 414 for a request line too long. h11's
bound holds only for a head that arrives in pieces, so ``head_refusal`` applies the same bound to
every request that reached the application.

A streamed reply writes its events through ``BodyWriter`` (the ASGI scope's ``BODY_WRITER``
extension) straight to the connection, as uvicorn's ``send`` writes a body message: a reply sends
an event per token, and the ASGI layers and h11's bookkeeping for each are a share of the event
loop's work on every token, which on two cores is taken from the forward. Its start and its last
message still go through ASGI.
"""

from __future__ import annotations

import asyncio
import math
from http import HTTPStatus

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from llama_chat.cmd.openai_api import ApiError, dumps

# h11's own bound on a request's line and headers, which uvicorn keeps unless told otherwise.
DEFAULT_MAX_HEAD_BYTES = 16 * 1024
# A refused request may leave bytes unread: its connection cannot carry another one.
CLOSE = {"Connection": "close"}
# Where a request's scope carries its connection's ``BodyWriter`` (under "extensions").
BODY_WRITER = "llama_chat.body_writer"


def head_refusal(scope: dict) -> ApiError | None:
    """The 414 or 431 for a request whose target or headers are past ``DEFAULT_MAX_HEAD_BYTES``
    (the same bound as h11's, for a head that came whole), else None."""
    target = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    if target > DEFAULT_MAX_HEAD_BYTES:
        return ApiError(414, f"the request line is longer than {DEFAULT_MAX_HEAD_BYTES} bytes", code="uri_too_long",
                        headers=CLOSE)
    if sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ())) > DEFAULT_MAX_HEAD_BYTES:
        return ApiError(431, f"the request's headers are larger than {DEFAULT_MAX_HEAD_BYTES} bytes",
                        code="headers_too_large", headers=CLOSE)
    return None


def reject(status: int, message: str, code: str) -> bytes:
    """A whole response refusing a request, as the API's error object; the connection closes."""
    body = dumps(ApiError(status, message, code=code).body())
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class BodyWriter:
    """Pieces of one response's body written to its connection as uvicorn's ``send`` writes an
    ``http.response.body`` message with more to come: in chunked coding to an HTTP/1.1 client (a
    body of unknown length, as h11 frames it), as they are to HTTP/1.0 (the close ends it); after a
    wait while the connection's buffer is full; dropped once the client has gone."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._chunked = cycle.conn.their_http_version == b"1.1"

    async def write(self, data: bytes) -> bool:
        """``data`` sent on (or dropped, the client gone); False, and nothing written, where the
        response has not started or has ended: send it as a message then."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return True
        if not cycle.response_started or cycle.response_complete or cycle.conn.our_state is not h11.SEND_BODY:
            return False
        if data:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return True


def _with_body_writer(app: ASGIApp) -> ASGIApp:
    """``app`` with a ``BodyWriter`` in the scope of each request whose body it may write: uvicorn's
    own ``send`` given, a method other than HEAD (whose response has no body)."""

    async def run(scope: Scope, receive: Receive, send: Send) -> None:
        cycle = getattr(send, "__self__", None)
        if isinstance(cycle, RequestResponseCycle) and scope.get("type") == "http" and scope.get("method") != "HEAD":
            scope.setdefault("extensions", {})[BODY_WRITER] = BodyWriter(cycle)
        await app(scope, receive, send)

    return run


class GuardedProtocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the header timeout, JSON refusals (``guarded_protocol``
    sets the timeout) and each request's ``BodyWriter``."""

    header_timeout_s: float = math.inf

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: h11.RemoteProtocolError | None = None
        self._max_head = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD_BYTES
        next_event = self.conn.next_event

        def next_event_kept() -> object:  # what h11 refused, for the answer (uvicorn drops it)
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._refusal = e
                raise

        self.conn.next_event = next_event_kept
        self.app = _with_body_writer(self.app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_in()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_in()
        elif self._header_timer is None and not self.transport.is_closing():
            self._wait_for_headers()  # the first bytes of the next request on a kept connection

    def send_400_response(self, msg: str) -> None:
        self._headers_in()
        e = self._refusal
        if e is not None and e.error_status_hint == 431:
            buffered, _ = self.conn.trailing_data
            if b"\n" not in buffered:
                answer = reject(414, f"the request line is longer than {self._max_head} bytes", "uri_too_long")
            else:
                answer = reject(431, f"the request's headers are larger than {self._max_head} bytes",
                                "headers_too_large")
        else:
            detail = f" ({e})" if e is not None and str(e) else ""
            answer = reject(e.error_status_hint if e is not None and 400 <= e.error_status_hint < 500 else 400,
                            f"the request is not valid HTTP{detail}", "bad_http_request")
        self.transport.write(answer)
        self.transport.close()

    def _wait_for_headers(self) -> None:
        self._headers_in()
        if math.isfinite(self.header_timeout_s):
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_in(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self.transport.write(reject(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s",
                                        "request_timeout"))
        self.transport.close()


def guarded_protocol(header_timeout_s: float) -> type[GuardedProtocol]:
    """The protocol class to give uvicorn's ``Config(http=...)``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"header_timeout_s": header_timeout_s})


__all__ = ["BODY_WRITER", "CLOSE", "DEFAULT_MAX_HEAD_BYTES", "BodyWriter", "GuardedProtocol", "guarded_protocol",
           "head_refusal", "reject"]
