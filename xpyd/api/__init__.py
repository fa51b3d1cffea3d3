"""The OpenAI-compatible HTTP API: request parsing and response builders (see ``openai``)."""
