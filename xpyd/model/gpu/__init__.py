"""The engine's CUDA path: what a worker runs with ``--device cuda``.

Paged decode attention and the KV store as Triton kernels over the pool in place (`paged_attention`),
sampling on the device with the CPU's one-draw-per-token contract (`sampler`), and decode steps captured
in CUDA graphs for the common batch sizes (`graphs`). Nothing here is imported on the CPU path; modules
that need Triton say why they cannot run where it is missing.
"""
