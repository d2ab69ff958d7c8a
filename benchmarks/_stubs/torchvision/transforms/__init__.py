"""Package of ``functional`` only."""
