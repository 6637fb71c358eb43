"""The Alembic migrations of the gateway's schema, run by :func:`gateway.store.migrate.migrate`."""
