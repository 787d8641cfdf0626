"""A small real HTTP server for bench tests (load generator, settle handshake): routes answer
200 with the bytes their handler returns; started and stopped by :func:`http_server`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[], bytes]


def _handler(routes: dict[tuple[str, str], Route], keep_alive: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 keeps connections open, as the load generator expects; 1.0 closes each one
        protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer("POST")

        def _answer(self, method: str) -> None:
            route = routes.get((method, self.path)) or routes.get((method, "*"))
            body = route() if route else b""
            self.send_response(200 if route else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass
    return Handler


@contextmanager
def http_server(host: str, routes: dict[tuple[str, str], Route], keep_alive: bool = True) -> Iterator[int]:
    """A threaded HTTP server on ``host`` answering ``routes`` ((method, path) -> body; path
    ``*`` matches any), its port yielded; shut down at the end of the block, whatever happened.
    ``keep_alive=False``: every answer closes its connection (a test counting sockets)."""
    srv = ThreadingHTTPServer((host, 0), _handler(routes, keep_alive))
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(10)
