"""The node's HTTP port (`--metrics-port`): Prometheus at `/metrics`, the status page at `/`,
its data at `/api/status` and `/api/history`.

The standard library's WSGI server (as prometheus_client's own), one thread per request, no
framework. Read-only: GET and HEAD; nothing of a request is echoed back. The page is three
static files from `static/` (HTML, script, style) that read the two JSON documents and draw
their charts as SVG; nothing is fetched from elsewhere, and the Content-Security-Policy says
so to the browser too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from importlib import resources
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

logger = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
Source = Callable[[], dict[str, Any]]  # a JSON document, read when asked

STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
]


def static_files() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("neuronode.node") / "static"
    return {path: ((folder / name).read_bytes(), kind) for path, (name, kind) in STATIC.items()}


class PageApp:
    """The WSGI application: routes, the static page, JSON from `api` sources, errors."""

    def __init__(self, *, metrics: WsgiApp, api: dict[str, Source]) -> None:
        self.metrics = metrics
        self.api = api
        self.files = static_files()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return self.reply(start_response, "405 Method Not Allowed", b"read-only: GET only\n",
                              "text/plain; charset=utf-8", [("Allow", "GET, HEAD")])
        if path == "/metrics":
            return self.metrics(environ, start_response)
        if not host_allowed(environ.get("HTTP_HOST", "")):
            return self.reply(start_response, "421 Misdirected Request",
                              b"open this page at an IP address or localhost, not a host name\n",
                              "text/plain; charset=utf-8")
        if path in self.files:
            body, kind = self.files[path]
            return self.reply(start_response, "200 OK", body, kind, [("Cache-Control", "no-cache")])
        if path in self.api:
            try:
                document = self.api[path]()
            except Unavailable as exc:
                return self.json(start_response, "503 Service Unavailable", {"error": str(exc)})
            except Exception:
                logger.exception("the status page's %s failed", path)
                return self.json(start_response, "500 Internal Server Error", {"error": "see the node's log"})
            return self.json(start_response, "200 OK", document)
        return self.reply(start_response, "404 Not Found", b"not found: try /, /api/status, /api/history or /metrics\n",
                          "text/plain; charset=utf-8")

    def json(self, start_response: Callable[..., Any], status: str, document: Any) -> Iterable[bytes]:
        body = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
        return self.reply(start_response, status, body, "application/json", [("Cache-Control", "no-store")])

    @staticmethod
    def reply(start_response: Callable[..., Any], status: str, body: bytes, kind: str,
              extra: list[tuple[str, str]] | None = None) -> Iterable[bytes]:
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body))),
                                *SECURITY_HEADERS, *(extra or [])])
        return [body]


def host_allowed(host_header: str) -> bool:
    """The page answers requests for an IP address or localhost only: a web page elsewhere that
    points a name of its own at 127.0.0.1 (DNS rebinding) cannot read the node's data through
    the visitor's browser. No Host header (not a browser) is fine."""
    if not host_header:
        return True
    if host_header.startswith("["):  # [IPv6]:port
        host = host_header[1:].partition("]")[0]
    else:
        host = host_header.rpartition(":")[0] if ":" in host_header else host_header
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Unavailable(Exception):
    """The node could not answer in time (it is starting or stopping)."""


def on_loop(loop: asyncio.AbstractEventLoop, read: Source, *, timeout_s: float = 5.0) -> Source:
    """`read`, called from a server thread but run on `loop` (where the state it reads changes)."""
    async def call() -> dict[str, Any]:
        return read()

    def document() -> dict[str, Any]:
        try:
            future = asyncio.run_coroutine_threadsafe(call(), loop)
        except RuntimeError:  # the loop closed: the node is stopping
            raise Unavailable("the node is stopping") from None
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Unavailable(f"the node did not answer within {timeout_s:.0f} s") from None
    return document


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """No line per request."""


class ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve(app: WsgiApp, host: str, port: int) -> WSGIServer:
    """Serve `app` on host:port from a daemon thread (shut it down with `server.shutdown()`)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingServer):
        address_family = family

    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=QuietHandler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
