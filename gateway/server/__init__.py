"""The uvicorn layer: ``gateway serve``, ``--workers``, the HTTP and WebSocket protocol subclasses, the
start-up lines."""
