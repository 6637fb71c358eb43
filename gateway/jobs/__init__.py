"""Background loops owned by the app's lifespan: the sweeper (and its thread), the webhook relay, the
demo workers."""
