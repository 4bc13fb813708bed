"""HTTP serving: an OpenAI-compatible API over any loomrl Engine (`loomrl serve`)."""
