"""The ``gateway`` command: ``gateway serve`` runs the gateway under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from gateway.settings import ConfigError, Settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="task-gateway: live task state over HTTP")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the gateway", description="Run the gateway. Every option also reads GATEWAY_*."
    )
    serve.add_argument("--host", help="address to bind (GATEWAY_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (GATEWAY_PORT, default 8000)")
    serve.add_argument("--database-url", help="sqlite:///file.db or postgresql://user@host/db")
    serve.add_argument("--secret", help="token signing secret (GATEWAY_SECRET)")
    serve.add_argument("--api-key", help="management API key (GATEWAY_API_KEY)")
    serve.add_argument("--log-level", help="uvicorn log level (GATEWAY_LOG_LEVEL, default info)")
    watch = commands.add_parser(
        "watch",
        help="watch a task live in the terminal",
        description="Show a task live until it ends; exit 0 succeeded, 1 failed, 3 expired, 4 error.",
    )
    watch.add_argument("task_id")
    watch.add_argument("--url", default=os.environ.get("GATEWAY_URL", "http://127.0.0.1:8000"))
    watch.add_argument("--token", default=os.environ.get("GATEWAY_TOKEN"), help="the task's subscribe token")
    watch.add_argument("--cursor", type=int, default=0, help="the last version already seen")
    args = parser.parse_args(argv)

    if args.command == "serve":
        return _serve(args)
    if args.command == "watch":
        import anyio

        from gateway.client.terminal import watch_in_terminal

        try:
            return anyio.run(watch_in_terminal, args.url, args.task_id, args.token, args.cursor)
        except KeyboardInterrupt:
            return 130
    return 2  # pragma: no cover  (argparse requires a command)


def _serve(args: argparse.Namespace) -> int:
    try:
        settings = Settings.from_environ(
            os.environ,
            host=args.host,
            port=args.port,
            database_url=args.database_url,
            secret=args.secret,
            api_key=args.api_key,
            log_level=args.log_level,
        )
        settings.check_bind()
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2

    from gateway.web.app import create_app
    from gateway.web.server import GatewayServer, server_config

    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(settings)
    config = server_config(
        app, settings.host, settings.port, log_level=settings.log_level, proxy_headers=True
    )
    GatewayServer(config, app).run()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
