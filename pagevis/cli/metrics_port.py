"""`--metrics-port N` for `pagevis run` and the app: Prometheus metrics of their session on 127.0.0.1:N."""

from __future__ import annotations

import argparse
import sys

from pagevis.cli.options import UsageError


def add_metrics_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, metavar="N",
                        help="serve Prometheus metrics of the session at http://127.0.0.1:N/metrics "
                             "(0 picks a free port)")


def check_port(port: int | None, flag: str = "--metrics-port") -> int | None:
    if port is not None and not 0 <= port <= 65535:
        raise UsageError(f"pagevis: {flag} {port}: must be a port number from 0 to 65535")
    return port


def start_metrics_server(port: int | None):
    """(Metrics, WSGI server) serving on 127.0.0.1:port, or (None, None) without a port."""
    if check_port(port) is None:
        return None, None
    from pagevis.observe import Metrics, serve_metrics

    metrics = Metrics()
    try:
        server = serve_metrics(metrics, port)
    except OSError as error:
        raise UsageError(f"pagevis: --metrics-port {port}: {error.strerror or error}") from None
    print(f"metrics: http://127.0.0.1:{server.server_port}/metrics", file=sys.stderr)
    return metrics, server
