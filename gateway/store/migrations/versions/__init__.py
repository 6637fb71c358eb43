"""One module per schema revision, oldest first: ``0001_initial`` is the schema of 0.1.0."""
