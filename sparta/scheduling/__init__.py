"""sparta.scheduling (arrives with its issue)."""
