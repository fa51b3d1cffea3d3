"""xpyd: disaggregated prefill/decode LLM serving.

Layers, top to bottom (checked by import-linter, pyproject.toml [tool.importlinter]):
  cli, launcher                               the commands
  prefill_worker | decode_worker | colocated_worker | proxy | bench
  worker                                      the worker runtime the roles share
  model | transfer | signal | discovery | api
  netaddr | child | histograms                leaf helpers
A package imports only from layers below it; packages on one line do not import each other.
"""

__version__ = "0.1.0"

# Version of the worker<->worker signal plane and transfer headers. Bump on any
# incompatible change to a message schema; peers refuse a mismatch at handshake.
PROTOCOL_VERSION = 10  # 10: a "not ready" lookup result carries the prefill worker's forward passes so far;
# 9: sessions per connection, opened by proving the cluster token (hello, challenge,
# proof; the token is never sent); a lookup's answer may continue in notifies before its reply;
# 8: KV streamed while prefill runs (status "prefilling", pulls in parts);
# 7: a pull carries a per-transfer secret; transfer headers and offers carry its MAC;
# 6: a paged KV cache: pulls name block lists, ready names the prompt's block hashes;
# 5: claims, pushed notify and heartbeats on the signal plane;
# 4: a signal frame is {version, seq, msg: {type, ...}} (msgspec tagged union);
# 3: a nixl Hello names the pool's memory (DRAM or VRAM + device); 2: shm confirms by its abort board

# Bytes of the random secret a decode worker makes for each KV transfer it expects and sends to the prefill
# worker inside the pull (signal plane); the sender proves it knows it (xpyd.transfer.auth).
TRANSFER_SECRET_BYTES = 32
