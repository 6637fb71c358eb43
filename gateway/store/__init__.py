"""Durable storage: the tables and the database they live in."""

from gateway.store.database import Database, async_url

__all__ = ["Database", "async_url"]
