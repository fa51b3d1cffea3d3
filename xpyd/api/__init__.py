"""The OpenAI-compatible HTTP API as data: request parsing and validation (`openai`) and response
and stream-chunk builders (`responses`), shared by the proxy and the worker HTTP API.

May import: the standard library and the leaf modules; no model, no worker, no network code.
"""
