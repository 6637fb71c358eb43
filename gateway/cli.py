"""The ``gateway`` command: ``gateway serve`` runs the gateway under uvicorn; ``gateway migrate`` brings the
database's schema to this release's revision (``gateway serve`` does that too, at start)."""

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
    serve.add_argument(
        "--workers", type=int, help="gateway processes on this port (GATEWAY_WORKERS, default 1; PostgreSQL)"
    )
    migrate = commands.add_parser(
        "migrate",
        help="upgrade the database schema to this release",
        description="Upgrade the database schema to the newest revision (gateway serve does so at start).",
    )
    migrate.add_argument("--database-url", help="sqlite:///file.db or postgresql://user@host/db")
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
    if args.command == "migrate":
        return _migrate(args)
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
            workers=args.workers,
        )
        settings.check_bind()
        settings.check_processes()
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2

    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if settings.workers > 1:
        from gateway.web.workers import serve_workers

        return serve_workers(settings, settings.workers)

    from gateway.web.app import create_app
    from gateway.web.server import GatewayServer, server_config

    app = create_app(settings)
    config = server_config(
        app, settings.host, settings.port, log_level=settings.log_level, proxy_headers=True
    )
    server = GatewayServer(config, app)
    server.run()
    if not server.started:
        return 3  # could not start (uvicorn's code)
    return 1 if server.failed else 0


def _migrate(args: argparse.Namespace) -> int:
    """Upgrade the database to head; one line on stdout, or one line on stderr (2: configuration, 1: the
    database could not be reached or migrated)."""
    import anyio

    from gateway.store.database import async_url

    try:
        settings = Settings.from_environ(os.environ, database_url=args.database_url)
        async_url(settings.database_url)  # an unsupported database is a configuration error
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    try:
        revision, head = anyio.run(_upgrade, settings.database_url)
    except Exception as exc:
        print(f"gateway: cannot migrate the database: {_one_line(exc)}", file=sys.stderr)
        return 1
    print(f"gateway: database at revision {revision}" + (" (head)" if revision == head else ""))
    return 0


async def _upgrade(url: str) -> tuple[str | None, str]:
    from gateway.store.database import Database
    from gateway.store.migrate import current_revision, head_revision, migrate

    db = Database(url)
    try:
        await migrate(db.engine)
        return await current_revision(db.engine), head_revision()
    finally:
        await db.close()


def _one_line(exc: BaseException) -> str:
    """An exception as one line: a driver's own message rather than SQLAlchemy's wrapping with the SQL."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException) and str(orig).strip():
        return str(orig).strip().splitlines()[0]
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
