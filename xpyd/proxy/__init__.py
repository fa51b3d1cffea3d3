"""The OpenAI-compatible proxy: sends each request to a prefill and a decode worker at once and relays
one OpenAI response or stream.

Owns: the app and its routes (`app`, `main`, `config`), the P/D call (`pd_call`, `decode_stream`,
`relay`), where a request goes and its call started (`dispatch`), worker sets, health and load polling
(`workers`, `poller`, `routing`), cache-aware routing
(the prompt's tokens and block hashes `prompt_tokens`, who caches what `prefix_index`, fed by
`cache_feed`), admission (`admission`, `inflight`), HTTP clients to workers (`client`, `upstream`,
`worker_api`), errors (`http_errors`), metrics (`metrics`) and the colocated baseline's proxy
(`colocated`).

May import: xpyd.api, xpyd.discovery, xpyd.signal (request ids) and the leaf modules; tokenizers and
jinja2 (to tokenize as the workers do); never the model, the worker runtime, the transfer engine, torch
or transformers.
"""
