"""sparta.moe (arrives with its issue)."""
