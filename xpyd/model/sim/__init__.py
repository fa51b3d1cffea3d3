"""The simulated engine (`--engine sim`): only the forward pass is replaced. A `SimRunner` has the real
runner's interface over a real KV pool in host memory (block manager, prefix cache and KV events are the
real ones); each token's KV row records a digest chained over the sequence, so tokens are a deterministic
function of the KV a worker holds (and the seed when sampling), and a transfer that moved the wrong bytes
gives other tokens or an error. Each forward pass takes the time a profile measured on the real engine
(`xpyd.model.sim_calibrate`), divided by a speed-up.

May import: the standard library and xpyd.model's torch-free modules (kv_layout, kv_blocks,
sampling_params, fingerprint); never torch or transformers.
"""
