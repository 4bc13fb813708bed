"""Parts built and tested on their own that no run uses yet (each module says what is missing before one can)."""
