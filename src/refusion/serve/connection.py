"""Below the app: the listening socket and each HTTP connection (uvicorn with h11).

`listen` binds the address before anything else happens, so a port in use is one clear error
before the model loads and before "serving on ..." is printed, and `--port 0` can print the port
the system chose.

uvicorn closes a connection left idle after a response (timeout_keep_alive) but has no limit on
how long a request line and its headers may take: a client that connects and sends nothing, or a
byte a second, holds its connection for good. uvicorn has no setting for this, so it is written
here, as the smallest change to its h11 protocol: a timer armed when a connection opens and when
the first bytes of a later request arrive, cancelled once h11 has parsed the headers; when it
fires, the connection is closed (with a 408 if part of a request came). HTTP/0.9 (`GET /` with no
version) would otherwise wait for a blank line that never comes: a first line without an HTTP
version is answered with a 400 at once.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import re
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from refusion.serve.app import ServeConfig

# looser than h11's grammar on purpose: only a line h11 would refuse anyway is refused early
_REQUEST_LINE = re.compile(rb"\S+ \S+ HTTP/[0-9]\.[0-9]")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers."""

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None
        self.line_checked = False  # this request's first line was seen and has a version

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in (a request is running), or the connection is over
            self.line_checked = False
            return
        if self.line_checked:
            return
        buffered = self.conn.trailing_data[0]
        if not buffered:
            return  # between requests: uvicorn's keep-alive timer runs
        if self.header_timer is None:  # the first bytes of a request on a kept-alive connection
            self.header_timer = self.loop.call_later(self.header_timeout, self._headers_late)
        end = buffered.find(b"\n")
        if end >= 0:
            if not _REQUEST_LINE.fullmatch(buffered[:end].removesuffix(b"\r")):
                self._refuse(400, "the request line must be METHOD TARGET HTTP/1.x (HTTP/0.9 is not supported)")
                return
            self.line_checked = True

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self._refuse(408, f"request headers not received within {self.header_timeout:g} s")
        else:
            self.transport.close()

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _refuse(self, status: int, message: str) -> None:
        """Answer in OpenAI's error shape and close; written by hand since h11 has no request to
        answer yet."""
        self._disarm()
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": None}}).encode()
        reason = {400: b"Bad Request", 408: b"Request Timeout"}[status]
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                % (status, reason, len(body)))
        self.transport.write(head + body)
        self.transport.close()


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` names (as asyncio's create_server binds them),
    all on one port: `port`, or the one the system picks for the first when it is 0. A ValueError
    with one line when an address cannot be had."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    socks: list[socket.socket] = []
    bound = port
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restart at once
            if family == socket.AF_INET6:  # "::" and "0.0.0.0" side by side, as asyncio does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr[0], bound, *addr[2:]))
            sock.listen(2048)
            bound = sock.getsockname()[1]  # the next addresses take the port the first got
    except OSError as e:
        for sock in socks:
            sock.close()
        hint = "; choose another --port (0: any free one)" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return socks


def uvicorn_server(app, cfg: ServeConfig, log_level: str = "info") -> uvicorn.Server:
    """uvicorn serving `app` with the configured timeouts; run it with `.run(sockets=listen(...))`."""
    config = uvicorn.Config(app, http=functools.partial(HeaderTimeoutProtocol, header_timeout=cfg.header_timeout),
                            timeout_keep_alive=cfg.keep_alive_timeout, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)
