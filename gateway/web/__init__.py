"""The web surface: HTTP routes, auth, wire shapes (and, next, WebSocket and SSE endpoints)."""
