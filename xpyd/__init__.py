"""xpyd: disaggregated prefill/decode LLM serving."""

__version__ = "0.1.0"

# Version of the worker<->worker signal plane and transfer headers. Bump on any
# incompatible change to a message schema; peers refuse a mismatch at handshake.
PROTOCOL_VERSION = 2  # 2: shm transfers confirm through the sender's abort board (one round trip)
