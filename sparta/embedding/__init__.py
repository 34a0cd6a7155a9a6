"""sparta.embedding (arrives with its issue)."""
