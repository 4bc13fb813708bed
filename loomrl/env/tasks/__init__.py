"""Task families."""
