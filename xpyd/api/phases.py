"""Where one answer's time went: each side's phases, as durations measured on its own clock.

The processes' monotonic clocks are not comparable, so no timestamp crosses a process: each side sends the
durations it measured, and the side that sees two of them joins them. Each side's phases add up exactly to
what it measured in all (the integers are differences of microsecond offsets from the same start).

The client's first token is prefill's (the proxy relays prefill's JSON answer), so its TTFT splits as::

    ingress    proxy    request received -> prefill call started (body read and parsed, the admission
                        queue, routing; a retried request's first try too)
    parse      prefill  its HTTP handler started -> request handed to the engine (validated, tokenized)
    queue      prefill  handed -> the forward pass of its first prompt chunk started
    compute    prefill  that pass started -> its first token sampled (all the prompt's chunks)
    respond    prefill  sampled -> its JSON answer built
    network    proxy    the prefill call less prefill's own time (parse .. respond): connecting, both hops,
                        both HTTP stacks: what neither side measured, shown, not hidden
    egress     proxy    prefill's answer read -> the first token's chunk written to the client's connection
                        (decode's request sent, the role chunk)
    ---------
    = the proxy's TTFT (``ProxyPhases.ttft_us``); the client's TTFT less this is the hop between the client
      and the proxy and the client's own reading (``xpyd bench``: "client/other")

Token 1 -> token 2 is the decode worker's, which started with prefill and ran alongside it::

    parse      decode   its HTTP handler started -> request handed to the engine
    wait       decode   handed -> its KV pull started (prefill's word on the prompt, room in the batch)
    transfer   decode   pull started -> the KV landed (when the engine learned it)
    queue      decode   landed -> the first decode step it ran in started (and prefill's first token,
                        when the KV came first: a pull streamed while the prompt was computed)
    step       decode   that step: the forward pass and token 2 sampled
    respond    decode   sampled -> its first chunk with text written
    ---------
    = decode's own time to its first chunk (``DecodePhases.total_us``)
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_US = 1 << 40  # ~12.7 days: anything longer is not a measurement
Micros = Annotated[int, msgspec.Meta(ge=0, le=MAX_US)]
SignedMicros = Annotated[int, msgspec.Meta(ge=-MAX_US, le=MAX_US)]

PREFILL_PHASES = ("parse", "queue", "compute", "respond")
DECODE_PHASES = ("parse", "wait", "transfer", "queue", "step", "respond")
PROXY_PHASES = ("ingress", "prefill_call", "network", "egress")
# The client's TTFT through a P/D proxy, in the order it passed: (side, phase)
TTFT_PHASES = (("proxy", "ingress"), ("prefill", "parse"), ("prefill", "queue"), ("prefill", "compute"),
               ("prefill", "respond"), ("proxy", "network"), ("proxy", "egress"))


class PrefillPhases(msgspec.Struct, frozen=True, kw_only=True):
    """The prefill worker's time to its answer (its ``ttft_us``), split."""

    parse_us: Micros
    queue_us: Micros
    compute_us: Micros
    respond_us: Micros

    @property
    def total_us(self) -> int:
        return self.parse_us + self.queue_us + self.compute_us + self.respond_us


class DecodePhases(msgspec.Struct, frozen=True, kw_only=True):
    """The decode worker's time to its first chunk with text (token 2 in P/D), split."""

    parse_us: Micros
    wait_us: Micros
    transfer_us: Micros
    queue_us: Micros
    step_us: Micros
    respond_us: Micros

    @property
    def total_us(self) -> int:
        return self.parse_us + self.wait_us + self.transfer_us + self.queue_us + self.step_us + self.respond_us


class ProxyPhases(msgspec.Struct, frozen=True, kw_only=True):
    """The proxy's time to the first token's chunk (``ttft_us``), split; ``network_us``: the prefill call less
    prefill's own time, when prefill said it (None otherwise). Signed: never below zero but by clock rate
    differences, which are shown as they are."""

    ingress_us: Micros
    prefill_call_us: Micros
    egress_us: Micros
    network_us: SignedMicros | None = None

    @property
    def ttft_us(self) -> int:
        return self.ingress_us + self.prefill_call_us + self.egress_us


def offsets_us(start: float, *stamps: float) -> list[int]:
    """Each stamp (seconds, one clock) as whole microseconds after ``start``, never before the previous one:
    the differences of these are phases that add up exactly to the last one."""
    out, last = [], 0
    for s in stamps:
        last = max(last, round((s - start) * 1_000_000))
        out.append(min(last, MAX_US))
    return out


def spans_us(start: float, *stamps: float) -> list[int]:
    """The phases between ``start`` and each successive stamp (``offsets_us``' differences)."""
    marks = offsets_us(start, *stamps)
    return [b - a for a, b in zip([0, *marks], marks)]


def ttft_split(prefill: PrefillPhases | None, proxy: ProxyPhases | None) -> dict[str, int] | None:
    """The client's TTFT as the proxy and prefill split it, ``TTFT_PHASES`` order, keyed ``side.phase``
    (summing to ``proxy.ttft_us`` exactly); None unless both sides said theirs."""
    if prefill is None or proxy is None or proxy.network_us is None:
        return None
    parts = {"proxy.ingress": proxy.ingress_us}
    parts.update({f"prefill.{p}": getattr(prefill, f"{p}_us") for p in PREFILL_PHASES})
    parts["proxy.network"] = proxy.network_us
    parts["proxy.egress"] = proxy.egress_us
    return parts
