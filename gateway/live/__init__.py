"""Live push: the pure fan-out core and its asyncio driver."""
