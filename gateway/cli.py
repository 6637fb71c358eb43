"""The ``gateway`` command: ``gateway serve`` runs the gateway under uvicorn; ``gateway migrate`` brings the
database's schema to this release's revision (``gateway serve`` does that too, at start); ``gateway watch``
shows a task (or with ``--tag`` every task of a tag) live; ``gateway token`` mints a task token or a tag
token for operators.

A configuration the gateway cannot use ends in one line on stderr and a non-zero exit, never a traceback:
2 for a setting, 3 (serve) or 1 (migrate) for a database that cannot be reached or migrated."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version

from gateway.errors import ConfigError, one_line
from gateway.settings import Settings, unknown_variables

# The exit code of `gateway serve` when it could not start (uvicorn's, and --workers').
STARTUP_FAILED = 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="task-gateway: live task state over HTTP")
    parser.add_argument("--version", action="version", version=f"gateway {package_version()}")
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
        help="watch a task, or every task of a tag, live in the terminal",
        description="Show a task live until it ends; exit 0 succeeded, 1 failed, 3 expired, 4 error. With "
        "--tag instead of a task id: every task carrying the tag and those created with it later, until "
        "Ctrl-C.",
    )
    watch.add_argument("task_id", nargs="?")
    watch.add_argument("--tag", help="watch every task carrying this tag (with a tag token)")
    watch.add_argument("--url", default=os.environ.get("GATEWAY_URL", "http://127.0.0.1:8000"))
    watch.add_argument(
        "--token",
        default=os.environ.get("GATEWAY_TOKEN"),
        help="the task's subscribe token, or with --tag a tag token",
    )
    watch.add_argument("--cursor", type=int, help="the last version already seen (default 0)")
    watch.add_argument(
        "--stream",
        metavar="NAME",
        help="print the text of the task's stream NAME (output, log, ...) as it is written, on stdout "
        "(the task's entries on stderr)",
    )
    token = commands.add_parser(
        "token",
        help="mint a task token or a tag token (for operators)",
        description="Print a subscribe or callback token for a task, or with --tag a tag token (it reads "
        "every task carrying the tag), signed with the secret the gateway uses (GATEWAY_SECRET, or the "
        "secret file beside its SQLite database). Only the token is printed; a note on stderr says when "
        "the database has no such task (yet).",
    )
    token.add_argument("scope", choices=("subscribe", "callback"))
    token.add_argument("task_id", nargs="?", help="the task (or --tag instead)")
    token.add_argument("--tag", help="a tag token for this tag instead of a task's token (scope subscribe)")
    token.add_argument("--ttl", default="24h", help="valid for: 3600, 90s, 15m, 24h, 7d (default 24h)")
    token.add_argument(
        "--database-url", help="the gateway's database, for its secret file (GATEWAY_DATABASE_URL)"
    )
    args = parser.parse_args(argv)

    if args.command == "serve":
        return _serve(args)
    if args.command == "migrate":
        return _migrate(args)
    if args.command == "token":
        return _token(args)
    if args.command == "watch":
        if (args.task_id is None) == (args.tag is None):
            watch.error("give a task id or --tag TAG (one of them)")
        if args.tag is not None and args.cursor is not None:
            watch.error("--cursor is for one task; with --tag each task resumes from where it is")
        if args.tag is not None and args.stream is not None:
            watch.error("--stream is for one task: give its id instead of --tag")
        return _watch(args)
    return 2  # pragma: no cover  (argparse requires a command)


def _watch(args: argparse.Namespace) -> int:
    import anyio

    from gateway.client.terminal import watch_in_terminal, watch_tag_in_terminal

    try:
        if args.tag is not None:
            return anyio.run(watch_tag_in_terminal, args.url, args.tag, args.token)
        return anyio.run(
            watch_in_terminal, args.url, args.task_id, args.token, args.cursor or 0, None, args.stream
        )
    except KeyboardInterrupt:
        return 130


def package_version() -> str:
    try:
        return version("task-gateway")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _warn_unknown(environ: Mapping[str, str]) -> None:
    warning = unknown_variables(environ)
    if warning is not None:
        print(f"gateway: warning: {warning}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from gateway.secret_file import with_secret
    from gateway.server.startup import announce, secret_source
    from gateway.store.database import check_database_url, check_processes

    _warn_unknown(os.environ)
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
        check_database_url(settings.database_url)
        _check_port(settings.host, settings.port)  # before the SQLite lock file is made for nothing
        check_processes(settings.database_url, settings.workers)
        source = secret_source(settings, option=args.secret is not None)
        settings = with_secret(settings)
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    # Reach the database and migrate it before uvicorn starts, so that an unreachable database is one line
    # here rather than a traceback from the lifespan (which then finds the schema at head), and learn the
    # deployment's id (made now on the first start), which names its Redis channel in the start-up lines.
    import anyio

    try:
        deployment = anyio.run(_prepare, settings.database_url)
    except Exception as exc:
        print(f"gateway: could not start: the database: {one_line(exc)}", file=sys.stderr)
        return STARTUP_FAILED

    from gateway.server.serve import setup_logging

    setup_logging(settings)
    if settings.workers > 1:
        from gateway.server.workers import serve_workers

        return serve_workers(settings, settings.workers, deployment_id=deployment, secret_source=source)

    from gateway.server.serve import GatewayServer, server_config, tune_interpreter
    from gateway.web.app import create_app

    app = create_app(settings)
    config = server_config(
        app, settings.host, settings.port, log_level=settings.log_level, proxy_headers=True
    )
    server = GatewayServer(
        config,
        app,
        on_listening=lambda host, port: announce(settings, source, host, port, deployment_id=deployment),
    )
    tune_interpreter()
    # Ctrl-C: uvicorn stops cleanly, then raises the SIGINT it caught again; that is the end, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        return STARTUP_FAILED
    return 1 if server.failed else 0


def _check_port(host: str, port: int) -> None:
    """``ConfigError`` when the address cannot be listened on (a port in use, an address not of this host),
    said before anything starts rather than by the server once the database is migrated."""
    if port == 0:
        return
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError(
                f"cannot listen on {host}:{port}: {reason.lower()} (pass --port or set GATEWAY_PORT)"
            ) from None


def _migrate(args: argparse.Namespace) -> int:
    """Upgrade the database to head; one line on stdout, or one line on stderr (2: configuration, 1: the
    database could not be reached or migrated)."""
    import anyio

    from gateway.store.database import check_database_url

    _warn_unknown(os.environ)
    try:
        settings = Settings.from_environ(os.environ, database_url=args.database_url)
        check_database_url(settings.database_url)  # an unsupported database is a configuration error
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    try:
        revision, head = anyio.run(_upgrade, settings.database_url)
    except Exception as exc:
        print(f"gateway: cannot migrate the database: {one_line(exc)}", file=sys.stderr)
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


async def _prepare(url: str) -> str:
    """Migrate the database; the deployment's id (``gateway.store.deployment``)."""
    from gateway.store.database import Database
    from gateway.store.deployment import deployment_id
    from gateway.store.migrate import migrate

    db = Database(url)
    try:
        await migrate(db.engine)
        return await deployment_id(db.engine)
    finally:
        await db.close()


_TTL = re.compile(r"(\d+)\s*([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _token(args: argparse.Namespace) -> int:
    """Print a token for ``args.task_id`` and ``args.scope``, or for ``args.tag``, valid for ``args.ttl``;
    one line on stderr and 2 when there is no secret to sign with or an argument or a setting is wrong."""
    from gateway.secret_file import secret_path, with_secret
    from gateway.tag_names import tag_problem
    from gateway.tokens import MAX_TAG_TOKEN_TTL_S, Tokens

    problem = _token_problem(args)
    ttl = _TTL.fullmatch(args.ttl.strip().lower())
    if problem is None and (ttl is None or int(ttl.group(1)) == 0):
        problem = f"--ttl {args.ttl!r}: use a positive number of seconds, or 90s, 15m, 24h, 7d"
    ttl_s = 0 if ttl is None else int(ttl.group(1)) * _UNIT_S[ttl.group(2)]
    if problem is None and args.tag is not None:
        tag = tag_problem(args.tag)
        if tag is not None:
            problem = f"--tag: {tag}"
        elif ttl_s > MAX_TAG_TOKEN_TTL_S:
            problem = f"--ttl {args.ttl!r}: a tag token lasts at most {MAX_TAG_TOKEN_TTL_S} s (365d)"
    if problem is not None:
        print(f"gateway: {problem}", file=sys.stderr)
        return 2
    try:
        settings = with_secret(
            Settings.from_environ(os.environ, database_url=args.database_url), create=False
        )
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    if settings.secret is None:
        path = secret_path(settings)
        where = (
            f"or run gateway serve once on this database, which makes {path}"
            if path is not None
            else "as the gateway has it (on PostgreSQL the gateway has no other secret that lasts)"
        )
        print(f"gateway: no secret to sign with: set GATEWAY_SECRET, {where}", file=sys.stderr)
        return 2
    tokens = Tokens(settings.secret.get_secret_value(), grace_s=0)
    if args.tag is not None:
        print(tokens.issue_tag(args.tag, ttl_s)[0])
        return 0
    print(tokens.issue(args.task_id, args.scope, ttl_s * 1000))
    _say_if_no_such_task(settings.database_url, args.task_id)
    return 0


def _token_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with asking for a task token and a tag token at once, or for neither."""
    if args.tag is not None and args.task_id is not None:
        return f"give a task id or --tag, not both: {args.task_id!r} and --tag {args.tag!r}"
    if args.tag is None and args.task_id is None:
        return "give a task id (a task's token) or --tag TAG (a tag token)"
    if args.tag is not None and args.scope != "subscribe":
        return "--tag makes a subscribe token (a tag token only reads): use gateway token subscribe --tag"
    return None


def _say_if_no_such_task(database_url: str, task_id: str) -> None:
    """A token may be minted before its task is created, but a typo in the id should not go unnoticed:
    one line on stderr when the gateway's database is reachable and has no such task (none when it cannot
    be told)."""
    import anyio

    from gateway.server.startup import describe_database
    from gateway.store.database import task_exists

    if anyio.run(task_exists, database_url, task_id, 3.0) is False:
        print(
            f"gateway: note: no task {task_id!r} in {describe_database(database_url)} yet; the token works "
            "once a task with this id is created",
            file=sys.stderr,
        )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
