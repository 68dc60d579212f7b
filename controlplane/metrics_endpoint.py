"""A process's own Prometheus endpoint (``GET /metrics``), behind the admin token.

Engine replicas serve one each (``ReplicaSettings.metrics_port``), so Prometheus can scrape
them without an OpenTelemetry Collector; it finds them through the ingress's
``GET /admin/metrics/targets`` (:func:`controlplane.status.prometheus_targets`). Per-tenant
series name every tenant, so the endpoint answers 401 without ``Authorization: Bearer
<admin token>``, like the ingress's ``/metrics``. It serves prometheus-client's default
registry: what :func:`controlplane.otel_metrics.configure_metrics` installed with
``prometheus=True``, and whatever else the process registers there (vLLM's ``vllm:*``
series when its stats are on).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from controlplane.auth import admin_token_ok, bearer

KEEP_TARGET_S = 60.0
"""How long a replica stays a scrape target after its last report: a replica busy in a
long step, or lost, is scraped (and shows ``up == 0``) rather than silently dropped."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        """Bind without ``HTTPServer``'s reverse-DNS lookup of the address (``getfqdn``),
        which can stall a replica's start where DNS is slow."""
        TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)
        self.setup_environ()


class _Quiet(WSGIRequestHandler):
    timeout = 10  # s: a client that connects and sends nothing does not keep a thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def guarded(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    """``app`` behind ``Authorization: Bearer <token>`` (401 otherwise)."""

    def guard(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not admin_token_ok(bearer(environ.get("HTTP_AUTHORIZATION")), token):
            headers = [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")]
            start_response("401 Unauthorized", headers)
            return [b"admin token missing or wrong\n"]
        return app(environ, start_response)

    return guard


class MetricsEndpoint:
    """``GET /metrics`` of ``registry`` on ``host:port`` (0: a free port) from daemon
    threads, behind ``token``. Binds in the constructor, so a taken port fails at once."""

    def __init__(
        self, host: str, port: int, token: str, registry: CollectorRegistry = REGISTRY
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("Server", (_Server,), {"address_family": family})
        app = guarded(make_wsgi_app(registry), token)
        self._server: WSGIServer = make_server(host, port, app, server_class, handler_class=_Quiet)
        self.port = int(self._server.server_address[1])
        shown = f"[{host}]" if family == socket.AF_INET6 else host  # a URL's host part
        self.address = f"{shown}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="vtoken-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
