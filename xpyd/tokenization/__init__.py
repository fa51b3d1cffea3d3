"""Tokenizing without transformers or torch: a model folder's tokenizer files (tokenizer.json, the chat
template, the special tokens) turned into token ids exactly as transformers does, and ids back into text.
The simulated engine's workers tokenize with it, and the proxy (cache-aware routing) with its prompt logic.

May import: tokenizers, jinja2, the standard library and the leaf modules; no model, no worker, no role.
"""
