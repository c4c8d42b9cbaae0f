"""The launcher's read-only HTTP endpoint (`recover train --http-port P [--http-host ADDR]`):
`GET /status` (the status model, `recover.app.status`, as JSON) and `GET /metrics` (the same
facts in the Prometheus text format, written by prometheus_client from its own registry).

Invariant: the endpoint only reads the run directory, at each request (it holds no state of the
run, so it cannot drift from `recover status`); it binds only the address it is given; it
answers GET (and HEAD) on those two paths, 404 on any other path and 405 to every write method,
changing nothing; it serves no token, no config secret, nothing but the status model. No client
can hold the launcher's descriptors or threads: at most `MAX_CONNECTIONS` are served at once (one
more is closed as it is accepted, logged rate-limited), each socket operation is bounded
(`TIMEOUT_S`) and so is a whole connection (`REQUEST_S`: a client that trickles a byte per read
is cut there). The server runs in a daemon thread that `close()` shuts down at the end of the run.
"""

from __future__ import annotations

import importlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from recover.app import rundir
from recover.app.status import read_status
from recover.errors import ConfigError, RecoverError

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # a client silent this long mid-request is dropped
# A whole connection (one request: HTTP/1.0, no keep-alive) is cut after this long, however it
# trickles; a scrape of a run directory's files takes milliseconds.
REQUEST_S = 10.0
# Connections served at once; more are closed as they are accepted. Each holds a thread and a
# descriptor for at most REQUEST_S: slow clients cost the launcher these, never all of its own.
MAX_CONNECTIONS = 32
_REFUSED_LOG_S = 10.0  # at most one line per this many seconds about refused connections
# Histogram buckets of a fault's recovery time: in-step recovery takes tens of milliseconds to
# a few seconds (a heartbeat timeout); a restart-from-checkpoint takes minutes.
RECOVERY_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
WRITES = ("POST", "PUT", "DELETE", "PATCH")


@dataclass
class HttpConfig:
    """Where the endpoint listens: `port` 0 = any free one (written to DIR/http.port)."""

    port: int
    host: str = "127.0.0.1"


def need_prometheus() -> Any:
    """prometheus_client, or a one-line ConfigError naming the extra that brings it."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        raise ConfigError("--http-port needs prometheus_client: install recover[http] "
                          "(pip install 'recover[http]')") from None


class StatusCollector:
    """The Prometheus view of the status model, computed afresh at each scrape."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        m = read_status(self.run_dir)
        yield CounterMetricFamily("recover_steps_committed", "optimizer steps committed",
                                  value=m["committed"])
        for name, doc, v in (
                ("recover_generation", "the membership's newest generation", m["generation"]),
                ("recover_live_replicas", "replicas in the newest generation",
                 m["live_replicas"]),
                ("recover_replicas", "replicas the run was started with", m["replicas"]),
                ("recover_loss", "training loss of the last committed step", m["loss"]),
                ("recover_tokens_per_second", "tokens per second, recent steps",
                 m["tokens_per_s"]),
                ("recover_eta_seconds", "estimated seconds to the last step", m["eta_s"])):
            if v is not None:
                yield GaugeMetricFamily(name, doc, value=v)
        quota = GaugeMetricFamily("recover_replica_quota",
                                  "microbatches a replica computed in the last step",
                                  labels=["replica"])
        for r, q in sorted(m["quotas"].items()):
            quota.add_metric([str(r)], q)
        yield quota
        speed = GaugeMetricFamily("recover_replica_microbatch_seconds",
                                  "a replica's seconds per microbatch, as the last step measured",
                                  labels=["replica"])
        for r in m["replica_states"]:
            if r["mb_time_s"] is not None:
                speed.add_metric([str(r["replica"])], r["mb_time_s"])
        yield speed
        # Unlabelled, so that it exists (at 0) before the first fault: a rate() needs that.
        yield CounterMetricFamily("recover_faults", "faults seen by the coordinator (a replica "
                                  "lost or fenced, a coordinator restarted)",
                                  value=len(m["faults"]))
        if m["store_requests"] is not None:
            yield CounterMetricFamily("recover_store_requests", "requests of the coordinator's "
                                      "main store (its own and every member's) since it started",
                                      value=m["store_requests"])
        secs = [r["recovery_s"] for r in m["recoveries"]]
        buckets = [(str(b), sum(s <= b for s in secs)) for b in RECOVERY_BUCKETS]
        yield HistogramMetricFamily("recover_recovery_seconds",
                                    "in-step recovery time of each step that recovered",
                                    buckets=[*buckets, ("+Inf", len(secs))],
                                    sum_value=sum(secs))


class _Handler(BaseHTTPRequestHandler):
    """GET /status and /metrics; 404 elsewhere; 405 to every write."""

    timeout = TIMEOUT_S  # every read of the request is bounded
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        path = self.path.split("?", 1)[0]
        try:
            if path == "/status":
                body = json.dumps(read_status(self.server.run_dir)).encode()
                ctype = "application/json"
            elif path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                body, ctype = generate_latest(self.server.registry), CONTENT_TYPE_LATEST
            else:
                self.send_error(404, "only /status and /metrics are served")
                return
        except RecoverError as e:  # the run directory is not (yet) readable as a run
            self.send_error(503, str(e))
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET  # noqa: N815

    def _refuse(self) -> None:
        self.send_response(405, "read-only")
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("http %s: " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a slow client never holds the launcher's exit
    run_dir: Path
    registry: Any
    max_connections = MAX_CONNECTIONS
    request_s = REQUEST_S

    def server_activate(self) -> None:
        self._live: dict[Any, float] = {}  # connection -> its deadline (monotonic)
        self._live_lock = threading.Lock()
        self._refused, self._refused_logged = 0, 0.0
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve it in a thread, unless `max_connections` are being served: then close it."""
        with self._live_lock:
            full = len(self._live) >= self.max_connections
            if not full:
                self._live[request] = time.monotonic() + self.request_s
        if full:
            self._refuse(client_address)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._live_lock:
            self._live.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Every poll interval (serve_forever's loop): cut connections past their deadline; the
        handler's blocked read or write then ends and its thread with it."""
        now = time.monotonic()
        with self._live_lock:
            late = [r for r, deadline in self._live.items() if deadline < now]
        for r in late:
            try:
                r.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its own thread

    def _refuse(self, client_address: Any) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= _REFUSED_LOG_S:
            self._refused_logged = now
            log.warning("http: %d connection(s) refused (%d served at once; the latest from "
                        "%s)", self._refused, self.max_connections, client_address[0])
            self._refused = 0


class _Server6(_Server):
    address_family = socket.AF_INET6


class Endpoint:
    """The running server; `close()` stops it (bounded) and frees its port."""

    def __init__(self, run_dir: Path, cfg: HttpConfig) -> None:
        prom = need_prometheus()
        server_cls = _Server6 if _family(cfg.host) == socket.AF_INET6 else _Server
        self.server = server_cls((cfg.host, cfg.port), _Handler)
        self.server.run_dir = run_dir
        self.server.registry = prom.CollectorRegistry(auto_describe=False)
        self.server.registry.register(StatusCollector(run_dir))
        self.port_file = run_dir / rundir.HTTP_PORT
        self.port = self.server.server_address[1]
        self.port_file.write_text(f"{self.port}\n")
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={
            "poll_interval": 0.2}, name="recover-http", daemon=True)
        self._thread.start()
        log.info("status endpoint on http://%s:%d/status and /metrics", cfg.host, self.port)

    def close(self) -> None:
        self.server.shutdown()  # returns within poll_interval
        self.server.server_close()
        self._thread.join(timeout=TIMEOUT_S)
        self.port_file.unlink(missing_ok=True)  # present only while the endpoint listens


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_address(cfg: HttpConfig) -> None:
    """ConfigError unless the endpoint's address can be bound now (tried, and let go: nothing of
    the run is made yet); the launcher binds it again once the run directory is laid out."""
    try:
        with socket.socket(_family(cfg.host), socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            s.bind((cfg.host, cfg.port))
    except (OSError, OverflowError) as e:
        raise ConfigError(f"--http-host {cfg.host} --http-port {cfg.port}: cannot listen there: "
                          f"{getattr(e, 'strerror', None) or e}") from None


def serve(run_dir: Path, cfg: HttpConfig | None) -> Endpoint | None:
    """The endpoint for this run (None when not asked for); a ConfigError if the address cannot be
    bound (in use, not this machine's)."""
    if cfg is None:
        return None
    try:
        return Endpoint(run_dir, cfg)
    except OSError as e:
        raise ConfigError(f"--http-host {cfg.host} --http-port {cfg.port}: cannot listen there: "
                          f"{e.strerror or e}") from None
