"""What names a model's weights: a digest of the files a worker loads, not of the name it serves them under.

Two workers agree on a KV block's hash (``xpyd.prefix_hash``) only when their KV bytes mean the same, which
takes the same weights: two fine-tunes of one base model served under one name must not share blocks. A
full digest of the weights would read every byte at each start (minutes for a large model), so this one
reads what tells weights apart::

    config.json's bytes
    for each *.safetensors file, by name: its name, size and header (tensor names, dtypes, shapes, offsets),
        and SAMPLES evenly spaced 4 KiB pieces of its data (two trainings of one architecture differ in
        every tensor, so in every piece)

The same files give the same digest wherever they lie (the folder's path is not in it). Not a defence
against weights crafted to collide: whoever can put weights on a worker owns its KV anyway.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLES = 64
PIECE = 4096
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own cap on the JSON header


def weights_fingerprint(folder: Path) -> str:
    """The digest (hex) of the model in ``folder`` (a Hugging Face safetensors folder); ValueError when it
    has no config.json or no safetensors file, or one is not a safetensors file."""
    folder = Path(folder)
    config = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not config.is_file() or not files:
        raise ValueError(f"{folder}: expected config.json and *.safetensors")
    h = hashlib.sha256(b"xpyd-weights/1")
    _part(h, config.read_bytes())
    for path in files:
        _part(h, path.name.encode())
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < header_len <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"{path}: not a safetensors file")
            _part(h, size.to_bytes(8, "little") + f.read(header_len))
            start, length = 8 + header_len, size - 8 - header_len
            for i in range(SAMPLES if length > 0 else 0):
                f.seek(start + (length - min(PIECE, length)) * i // max(1, SAMPLES - 1))
                _part(h, f.read(PIECE))
    return h.hexdigest()


def _part(h, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little") + data)
