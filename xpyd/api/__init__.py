"""The OpenAI-compatible HTTP API as data: request parsing and validation (`openai`), response
and stream-chunk builders (`responses`), shared by the proxy and the worker HTTP API, and the
reading of an SSE stream (`sse`), shared by the proxy and the bench client.

May import: the standard library and the leaf modules; no model, no worker, no network code.
"""
