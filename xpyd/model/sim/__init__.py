"""The simulated engine (`--engine sim`): only the forward pass is replaced. A `SimRunner` has the real
runner's interface over a real KV pool in host memory (block manager, prefix cache and KV events are the
real ones); each token's KV row records a digest chained over the sequence, so tokens are a deterministic
function of the KV a worker holds (and the seed when sampling), and a transfer that moved the wrong bytes
gives other tokens or an error. Each forward pass takes the time a profile measured on the real engine
(`xpyd.model.sim_calibrate`), divided by a speed-up. See docs/sim.md.

Modules: `runner` (SimRunner), `records` (the per-token KV records and their chained digest), `sampler`
(SimSampler: digests to tokens), `profile` (SimProfile; the built-in one in `profiles/`).

May import: the standard library and xpyd.model's torch-free modules (kv_layout, kv_blocks,
sampling_params, fingerprint); never torch or transformers.
"""

from xpyd.model.sim.profile import SimProfile, default_profile
from xpyd.model.sim.records import BadRecord
from xpyd.model.sim.runner import SimRunner
from xpyd.model.sim.sampler import SimGenerator, SimSampler

__all__ = ["BadRecord", "SimGenerator", "SimProfile", "SimRunner", "SimSampler", "default_profile"]
