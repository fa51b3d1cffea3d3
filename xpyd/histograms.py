"""Prometheus histogram buckets shared by the proxy and the workers, so that a latency the client sees
(proxy) and the same latency inside a worker fall into the same buckets and compare bucket for bucket.

A leaf module: it imports nothing of xpyd.
"""

# From a millisecond (a decode step of a tiny model) to tens of seconds (a long prompt on a busy CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                       0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
# One phase of a request (``xpyd.api.phases``): from tens of microseconds (parsing, a loopback hop) up.
PHASE_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4) + LATENCY_BUCKETS
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
