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

A JSON answer's first token reaches the client with its last, so the proxy's time to the answer splits as the
TTFT above with the rest of the answer before egress::

    ingress, prefill parse/queue/compute/respond, network     as above
    rest       proxy    prefill's answer read -> decode's last token read (tokens 2..n)
    egress     proxy    -> the JSON answer built
    ---------
    = the proxy's time to the answer (``ProxyPhases.ttft_us``)

Several choices (``n`` > 1, a list of prompts; ``xpyd.proxy.choices``): the response starts once every choice
has its first token, so the request's split follows its first choice (index 0) and names the wait for the
others::

    ingress, prefill parse/queue/compute/respond, network     choice 0's
    choices    proxy    choice 0's answer read -> the last choice's first token read
    [rest]     proxy    (a JSON answer) -> every choice's last token read
    egress     proxy    -> the first content chunk written / the JSON answer built

A colocated worker computes the prompt and decodes on one engine (no transfer); its own time to its first
chunk (or its JSON answer) splits as prefill's, with the rest of a JSON answer before respond, and the colocated
proxy adds its ingress, call (``prefill_call``), network and egress as the P/D proxy does::

    parse      colocated  its HTTP handler started -> request handed to the engine
    queue      colocated  handed -> its prompt's forward pass started
    compute    colocated  that pass started -> its first token sampled
    [rest]     colocated  (a JSON answer) -> its last token sampled
    respond    colocated  -> its first chunk with text written / its JSON answer built
    ---------
    = the colocated worker's time to its first chunk or answer (``ColocatedPhases.total_us``)

and, streamed, the first decode step after it (``StepPhases``): token 1 sampled -> the first decode step it
ran in started (``queue``: the prefills run before it), that step (``step``), -> the next chunk with text
written (``respond``).

A prompt its decode worker prefilled itself (``xpyd.api.local_prefill``: no prefill worker took part) splits
the same way: decode's parse, queue, compute and respond to its first token's chunk (in ``colocated``), and
the P/D proxy's ingress, call (the decode call up to that chunk), network and egress.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_US = 1 << 40  # ~12.7 days: anything longer is not a measurement
Micros = Annotated[int, msgspec.Meta(ge=0, le=MAX_US)]
SignedMicros = Annotated[int, msgspec.Meta(ge=-MAX_US, le=MAX_US)]

PREFILL_PHASES = ("parse", "queue", "compute", "respond")
DECODE_PHASES = ("parse", "wait", "transfer", "queue", "step", "respond")
PROXY_PHASES = ("ingress", "prefill_call", "network", "choices", "rest", "egress")
COLOCATED_PHASES = ("parse", "queue", "compute", "rest", "respond")  # (its time to its first chunk or answer)
STEP_PHASES = ("queue", "step", "respond")  # a colocated worker's first decode step
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


class StepPhases(msgspec.Struct, frozen=True, kw_only=True):
    """A colocated worker's first decode step: its first token sampled -> the next chunk with text written."""

    queue_us: Micros
    step_us: Micros
    respond_us: Micros

    @property
    def total_us(self) -> int:
        return self.queue_us + self.step_us + self.respond_us


class ColocatedPhases(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A colocated worker's time to its first chunk with text (its ``ttft_us``), or to its JSON answer, split:
    prefill's phases, with ``rest_us`` (a JSON answer's tokens after the first) before respond; ``step``: a
    stream's first decode step (None: a JSON answer, or no second chunk)."""

    parse_us: Micros
    queue_us: Micros
    compute_us: Micros
    respond_us: Micros
    rest_us: Micros | None = None
    step: StepPhases | None = None

    @property
    def total_us(self) -> int:
        return self.parse_us + self.queue_us + self.compute_us + (self.rest_us or 0) + self.respond_us


class ProxyPhases(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The proxy's time to the client's first token (``ttft_us``: its chunk written, or the JSON answer built),
    split; ``network_us``: the first-token call less its worker's own time, when the worker said it (None
    otherwise). Signed: never below zero but by clock rate differences, which are shown as they are.
    ``choices_us``: several choices' wait for the others' first tokens; ``rest_us``: a JSON answer's wait for
    its last token (None where they do not apply)."""

    ingress_us: Micros
    prefill_call_us: Micros
    egress_us: Micros
    network_us: SignedMicros | None = None
    choices_us: Micros | None = None
    rest_us: Micros | None = None

    @property
    def ttft_us(self) -> int:
        return self.ingress_us + self.prefill_call_us + (self.choices_us or 0) + (self.rest_us or 0) + self.egress_us


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


def ttft_split(worker: PrefillPhases | ColocatedPhases | None, proxy: ProxyPhases | None) -> dict[str, int] | None:
    """The client's TTFT (a JSON answer: its time to the answer) as the proxy and the worker of the first token
    (prefill, or a colocated worker) split it, in the order it passed, keyed ``side.phase`` (``TTFT_PHASES`` for
    a streamed P/D answer; ``rest`` and ``choices`` where they apply), summing to ``proxy.ttft_us`` exactly;
    None unless both sides said theirs."""
    if worker is None or proxy is None or proxy.network_us is None:
        return None
    side = "colocated" if isinstance(worker, ColocatedPhases) else "prefill"
    parts = {"proxy.ingress": proxy.ingress_us, f"{side}.parse": worker.parse_us, f"{side}.queue": worker.queue_us,
             f"{side}.compute": worker.compute_us}
    if isinstance(worker, ColocatedPhases) and worker.rest_us is not None:
        parts[f"{side}.rest"] = worker.rest_us
    parts[f"{side}.respond"] = worker.respond_us
    parts["proxy.network"] = proxy.network_us
    for name in ("choices", "rest"):
        if (us := getattr(proxy, f"{name}_us")) is not None:
            parts[f"proxy.{name}"] = us
    parts["proxy.egress"] = proxy.egress_us
    return parts
