"""sparta.parallel (arrives with its issue)."""
