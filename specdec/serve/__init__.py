"""The OpenAI-compatible HTTP server (specdec serve)."""
