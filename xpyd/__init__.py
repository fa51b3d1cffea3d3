"""xpyd: disaggregated prefill/decode LLM serving."""

__version__ = "0.1.0"

# Version of the worker<->worker signal plane and transfer headers. Bump on any
# incompatible change to a message schema; peers refuse a mismatch at handshake.
PROTOCOL_VERSION = 3  # 3: a nixl Hello names the pool's memory (DRAM or VRAM + device); 2: shm confirms by its abort board
