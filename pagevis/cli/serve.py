"""`pagevis serve`: the HTTP API (pagevis.serve) on uvicorn, on loopback unless told otherwise."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from pagevis import settings
from pagevis.cli import options
from pagevis.cli.options import UsageError

FRONT_END = "serve"

LOCAL_NAMES = ("localhost",)
SECTIONS = ("network", "scheduler", "limits", "kv_events")  # the table's sections serve adds, with its defaults


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "serve", help="serve the engine, decoding sessions and OpenAI-compatible completions over HTTP",
        description="Serve POST /v1/attention, /v1/sessions, OpenAI-compatible /v1/completions and "
                    "/v1/chat/completions, /metrics (Prometheus) and /healthz; API docs at /docs. Cache and "
                    "decoding options set the defaults of sessions and completions that do not set them: by "
                    "default a full cache per request (policy none), so nothing is evicted, its K/V in float32 "
                    "(--dtype float16 halves their memory, at about the same speed: docs/serving.md). By default "
                    "every row (prompts, a request decoding alone, requests decoding together) multiplies int8 "
                    "activations by the quantised weights (--int8-rows all; AVX-512 VNNI, where the CPU has it: "
                    "llama.cpp's arithmetic, each row within a tested bound of the exact row); prompt scoring (echo, "
                    "prompt logprobs) stays exact; --int8-rows none answers as `pagevis run` does, bit for bit.")
    for section in SECTIONS:
        group = parser.add_argument_group(settings.SECTIONS[section])
        settings.add_flags(group, section, front_end=FRONT_END)
        if section == "scheduler":
            settings.add_flags(group, names=("pool_pages", "int8_rows"), front_end=FRONT_END)
    options.add_model_options(parser)
    options.add_cache_options(parser, FRONT_END)
    options.add_decoding_options(parser, FRONT_END)
    parser.set_defaults(handler=main, chat=None)
    return parser


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a non-loopback address unless --allow-remote; warn when it is allowed."""
    if host in LOCAL_NAMES or _is_loopback(host):
        return
    if not allow_remote:
        raise UsageError(f"--host {host} is not a loopback address; the server has no "
                         "authentication, so binding it where others can reach it needs --allow-remote")
    print(f"pagevis serve: warning: listening on {host}: anyone who can reach this address can use the server "
          "(no authentication)", file=sys.stderr)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def settings_from_args(args: argparse.Namespace):
    """ServeSettings from the flags (validated before anything starts); the cache and decoding flags set the
    defaults of requests."""
    from pagevis.serve.sessions import session_config
    from pagevis.serve.settings import ServeSettings, serve_defaults

    given = options.given_settings(args)
    defaults = options.session_config(args, base=serve_defaults())
    base = ServeSettings(model_spec=options.model_spec(args), defaults=defaults, full_cache=args.max_pages is None)
    served = settings.apply(base, given)
    session_config(served, {})  # what a request that sets nothing gets must be allowed (--max-pages 1000 is not)
    return served


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from pagevis.serve.app import Server, create_app

    served = settings_from_args(args)
    check_host(served.host, served.allow_remote)
    if served.request_log:
        options.check_writable(served.request_log, "--request-log")
    app = create_app(served)
    # Connections beyond the limit get 503 at once rather than queueing without bound. On SIGTERM the server
    # drains (--drain-seconds), then every stream has ended: 5 s more is plenty for the last bytes.
    limit = max(64, 2 * (served.max_seqs + served.max_waiting + served.max_sessions))
    config = uvicorn.Config(app, host=served.host, port=served.port, log_level="info", timeout_graceful_shutdown=5,
                            limit_concurrency=limit)
    Server(config, app).run()
    return 0
