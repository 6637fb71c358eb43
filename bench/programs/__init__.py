"""What the bench starts as processes of its own: ``python -m bench.programs.<name> ...`` (see each)."""
