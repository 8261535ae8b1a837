"""`pagevis serve`: the HTTP API (pagevis.serve) on uvicorn, on loopback unless told otherwise."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from pagevis.cli import options
from pagevis.cli.options import UsageError

LOCAL_NAMES = ("localhost",)
LIMIT_FLAGS = (  # flag (a ServeSettings field), type, metavar, help
    ("--max-body", int, "BYTES", "largest request body; bigger ones get 413 unread"),
    ("--max-sessions", int, "N", "live /v1/sessions sessions at once"),
    ("--max-running", int, "N", "requests one engine decodes in each step (its batch)"),
    ("--max-waiting", int, "N", "completions waiting beyond --max-running (over all engines); more get 429"),
    ("--token-budget", int, "N", "tokens one step feeds over all requests: a long prompt is prefilled in chunks "
                                 "between the others' decode steps; 0 = no limit"),
    ("--pool-pages", int, "N", "pages per layer in each engine's shared pool (default: --max-running requests of "
                               "the default cache, and at least --max-cache-tokens)"),
    ("--max-pools", int, "N", "engines at once, one per cache layout (page size, dtype) requests ask for"),
    ("--drain-seconds", float, "SECONDS", "on SIGTERM or Ctrl-C: how long requests in flight may go on before "
                                          "they end with finish_reason \"abort\""),
    ("--max-session-tokens", int, "N", "prompt + generated tokens of one session"),
    ("--max-cache-tokens", int, "N", "page size x max pages of one session"),
    ("--max-session-mib", int, "MIB", "memory of one session's KV caches and step snapshots (checked before it "
                                      "starts)"),
    ("--idle-timeout", float, "SECONDS", "delete sessions unused this long"),
    ("--workers", int, "N", "worker threads for /v1/attention, prompt encoding and answers"),
)


def add_parser(commands) -> argparse.ArgumentParser:
    from pagevis.serve.settings import ServeSettings

    limits = ServeSettings()
    parser = commands.add_parser(
        "serve", help="serve the engine, decoding sessions and OpenAI-compatible completions over HTTP",
        description="Serve POST /v1/attention, /v1/sessions, OpenAI-compatible /v1/completions and "
                    "/v1/chat/completions, /metrics (Prometheus) and /healthz; API docs at /docs. Cache and "
                    "decoding options set the defaults of sessions and completions that do not set them.")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    net.add_argument("--allow-remote", action="store_true",
                     help="allow a --host other than loopback: anyone who reaches it can use the server, "
                          "which has no authentication")
    group = parser.add_argument_group("limits")
    for flag, kind, metavar, text in LIMIT_FLAGS:
        default = getattr(limits, flag.removeprefix("--").replace("-", "_"))
        shown = f" (default {default:g})" if default is not None else ""
        group.add_argument(flag, type=kind, default=default, metavar=metavar, help=text + shown)
    events = parser.add_argument_group("KV events (vLLM's format: docs/serving.md)")
    events.add_argument("--kv-events-endpoint", metavar="ENDPOINT",
                        help="publish the engines' prefix caches as vLLM KV events on this ZMQ PUB endpoint, e.g. "
                             "tcp://*:5557 (bound) or tcp://HOST:PORT (connected); `pagevis attach` reads them")
    events.add_argument("--kv-events-replay", metavar="ENDPOINT", help="answer replay requests (ZMQ ROUTER) here, "
                                                                        "e.g. tcp://*:5558")
    events.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="the topic of every message")
    options.add_model_options(parser)
    options.add_cache_options(parser)
    options.add_decoding_options(parser)
    parser.set_defaults(handler=main, chat=None)
    return parser


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback address unless --allow-remote; warn when it is allowed."""
    if host in LOCAL_NAMES or _is_loopback(host):
        return
    if not allow_remote:
        raise UsageError(f"pagevis serve: --host {host} is not a loopback address; the server has no "
                         "authentication, so binding it where others can reach it needs --allow-remote")
    print(f"pagevis serve: warning: listening on {host}: anyone who can reach this address can use the server "
          "(no authentication)", file=sys.stderr)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def settings_from_args(args: argparse.Namespace):
    from pagevis.serve.settings import ServeSettings

    if args.idle_timeout <= 0:
        raise UsageError(f"pagevis serve: --idle-timeout {args.idle_timeout:g}: must be more than 0 seconds")
    # The cache and decoding flags set the defaults of requests (validated before anything starts).
    defaults = options.session_config(args)
    if args.drain_seconds < 0:
        raise UsageError(f"pagevis serve: --drain-seconds {args.drain_seconds:g}: must be 0 or more")
    return ServeSettings(model_spec=options.model_spec(args), defaults=defaults, max_body=args.max_body,
                         max_sessions=args.max_sessions, max_session_tokens=args.max_session_tokens,
                         max_cache_tokens=args.max_cache_tokens, max_session_mib=args.max_session_mib,
                         idle_timeout=args.idle_timeout, workers=args.workers, max_running=args.max_running,
                         max_waiting=args.max_waiting, token_budget=args.token_budget or None,
                         pool_pages=args.pool_pages, max_pools=args.max_pools, drain_seconds=args.drain_seconds,
                         kv_events_endpoint=args.kv_events_endpoint, kv_events_replay=args.kv_events_replay,
                         kv_events_topic=args.kv_events_topic)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from pagevis.serve.app import Server, create_app

    check_host(args.host, args.allow_remote)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"pagevis serve: --port {args.port}: must be a port number from 0 to 65535")
    settings = settings_from_args(args)
    app = create_app(settings)
    # Connections beyond the limit get 503 at once rather than queueing without bound. On SIGTERM the server
    # drains (--drain-seconds), then every stream has ended: 5 s more is plenty for the last bytes.
    limit = max(64, 2 * (settings.max_running + settings.max_waiting + settings.max_sessions))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5,
                            limit_concurrency=limit)
    Server(config, app).run()
    return 0
