"""The OpenAI-compatible HTTP server (`pressroom serve`)."""
