"""The model layer: everything that computes tokens, and nothing that knows about a network or a role.

Owns: loading and GGUF conversion (`loader`), the tokenizer and chat template (`tokenizer`), the forward
passes over the KV pool (`runner`, the lean Llama forward `llama_fast`, the general path `general_path`,
native CPU kernels `native` + `csrc/`), the preallocated KV pool (`kv_pool`), the KV blocks' reference
counts, prefix cache and LRU eviction (`kv_blocks`; blocks are named by `xpyd.prefix_hash`), sampling (`sampling`), the logprobs of chosen
and prompt tokens (`logprobs`, torch-free; computed by `logprobs_torch`) and detokenization with stop strings (`output`). The simulated engine (`sim`: the same runner interface, no
torch) and its calibration against the real runner (`sim_calibrate`).

May import: torch, transformers and the standard library; nothing else of xpyd (`sim` and the torch-free
modules it uses import neither torch nor transformers).
"""
