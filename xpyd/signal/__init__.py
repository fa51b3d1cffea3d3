"""The signal plane between prefill and decode workers (ZMQ ROUTER/DEALER, msgpack via msgspec).

Owns: the typed, versioned messages (`messages`), the request id that carries both workers' addresses
(`request_id`), prefill's ROUTER server (`server`) and decode's DEALER client per prefill peer (`client`).

May import: pyzmq, msgspec, the standard library and the leaf modules; no model, no worker, no role.
"""
