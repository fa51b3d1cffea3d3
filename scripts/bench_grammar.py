"""Measure grammar engines for structured output on this CPU: what a worker pays to constrain sampling.

    .venv/bin/python scripts/bench_grammar.py [--engines xgrammar,llguidance,outlines-core,xpyd.model.grammar]
                                              [--reps 3] [--walks 5] [--json FILE]

For each engine installed (the others are reported as missing), on SmolLM2-135M-Instruct's tokenizer with the
model's logits size (config.vocab_size); ``xpyd.model.grammar`` is the engine chosen (llguidance) through xpyd's
interface, as the workers call it (its mask a new ``bytes`` each step):

- import: the engine's import time in a fresh interpreter, and whether importing it imports torch;
- tokenizer info: the one-time per-worker build of the engine's view of the vocabulary;
- compile: the median of --reps compilations (no engine cache) of (a) json_object (any JSON object), (b) a
  realistic JSON schema (string, integer with minimum, enum, array of strings, nested object, required fields,
  additionalProperties false), (c) the regex ``\\d{3}-\\d{4}``, (d) a choice of 4 strings, (e) a small SQL
  grammar (Lark; "-" where the engine takes no context-free grammar). Each ends with the first mask filled,
  so lazy work is counted;
- matcher: a fresh per-request matcher from the compiled schema (b);
- per token: walking a fixed valid ~200-token JSON document (valid for (b)) under (b) and under (a): at each
  step fill the packed int32 bitmask, check the next token is allowed (not timed), accept it; then EOS must be
  allowed. p50/p99/mean of fill + accept over --walks walks after a first one, in microseconds (fill and accept
  are also kept apart in --json);
- first request: the compile time plus the whole first walk (an engine that defers work to the first masks pays
  it there; one that precomputes pays it in compile).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "status": {"enum": ["active", "inactive", "pending", "banned"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "notes": {"type": "string"},
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "status": "active",
    "tags": ["mathematician", "writer", "analyst", "programmer", "poet", "translator", "engineer", "pioneer",
             "countess", "visionary", "musician", "scholar", "correspondent", "metaphysician"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "notes": ("Wrote the first published algorithm intended for a machine, the Analytical Engine of Charles "
              "Babbage, and foresaw that such machines could compose music and manipulate symbols of any kind, "
              "not only numbers; her notes on the engine, translated from an Italian article by Luigi Menabrea, "
              "were three times longer than the article itself and include a method for Bernoulli numbers."),
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral", "mixed"]
LARK = r"""
start: "SELECT " cols " FROM " ident (" WHERE " cond)? ";"
cols: "*" | ident (", " ident)*
cond: ident " " op " " value
op: "=" | "<" | ">"
value: /[0-9]+/ | /'[a-z ]*'/
ident: /[a-z_][a-z0-9_]*/
"""
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
ENGINES = ("xgrammar", "llguidance", "outlines-core", "xpyd.model.grammar")
MODULES = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines-core": "outlines_core"}


def _spec_value(kind: str) -> str:
    return {"json_object": "", "json_schema": json.dumps(SCHEMA), "regex": REGEX, "choice": json.dumps(CHOICES),
            "grammar": LARK}[kind]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)

    def compile(self, kind: str, value: str):
        c = self.compiler
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=True)
        if kind == "json_schema":
            return c.compile_json_schema(value, any_whitespace=True, strict_mode=True)
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(value)))
        return c.compile_lark(value)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, buf: np.ndarray) -> None:
        m.fill_next_token_bitmask(buf)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        import llguidance as llg

        self.llg = llg
        self.tok = llg.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos)

    def compile(self, kind: str, value: str):
        llg = self.llg
        if kind == "json_object":
            g = llg.grammar_from("json_schema", '{"type": "object"}')
        elif kind == "json_schema":
            g = llg.grammar_from("json_schema", value)
        elif kind == "regex":
            g = llg.grammar_from("regex", value)
        elif kind == "choice":
            g = llg.grammar_from("choice", value)
        else:
            g = llg.grammar_from("lark", value)
        m = llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m  # the compiled form: a pristine matcher, deep-copied per request

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, buf: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        import outlines_core as oc

        self.oc = oc
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tok.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i == eos[0]:
                continue
            raw = text.encode() if i in special else bytes(byte_of[c] for c in text)
            tokens.setdefault(raw, []).append(i)
        self.vocab = oc.Vocabulary(eos[0], tokens)

    def compile(self, kind: str, value: str):
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json_object":
            regex = build_regex_from_schema('{"type": "object"}')
        elif kind == "json_schema":
            regex = build_regex_from_schema(value)
        elif kind == "regex":
            regex = value
        elif kind == "choice":
            regex = "|".join(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", s) for s in json.loads(value))
        else:
            return None  # no context-free grammars
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, buf: np.ndarray) -> None:
        m.write_mask_into(buf.ctypes.data, buf.size, 4)

    def accept(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (byte-level BPE vocabularies are written in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Xpyd:
    """llguidance through xpyd.model.grammar (what the engines will call): ``allowed()`` returns a new ``bytes``."""

    name = "xpyd.model.grammar"

    def __init__(self, tok, vocab: int, eos: list[int]) -> None:
        from xpyd.model import grammar

        self.grammar = grammar
        self.grammars = grammar.Grammars(tok, vocab, frozenset(eos))

    def compile(self, kind: str, value: str):
        self.grammars._cache.clear()  # time the compilation, not the cache
        return self.grammars.compile(self.grammar.GrammarSpec(kind, value))

    def matcher(self, compiled):
        return compiled.matcher()

    def fill(self, m, buf: np.ndarray) -> bytes:
        return m.allowed()

    def accept(self, m, token: int) -> bool:
        return m.accept(token)


CLASSES = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines-core": OutlinesCore, "xpyd.model.grammar": Xpyd}
MODULES["xpyd.model.grammar"] = "xpyd.model.grammar"


def _allowed(mask, token: int) -> bool:
    if isinstance(mask, bytes):
        return (mask[token >> 3] >> (token & 7)) & 1 == 1
    return (int(mask[token >> 5]) >> (token & 31)) & 1 == 1


def _import_cost(module: str) -> dict:
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "import failed"}
    seconds, torch = out.stdout.split()
    return {"import_ms": float(seconds) * 1e3, "imports_torch": torch == "True"}


def _walk(engine, compiled, doc_tokens: list[int], eos: list[int], words: int) -> tuple[list[int], list[int]]:
    m = engine.matcher(compiled)
    buf = np.zeros(words, dtype=np.int32)
    fills, accepts = [], []
    for t in doc_tokens:
        t0 = time.perf_counter_ns()
        mask = engine.fill(m, buf)
        t1 = time.perf_counter_ns()
        if not _allowed(buf if mask is None else mask, t):
            raise RuntimeError(f"{engine.name}: the document's token {t} is not in the mask")
        t2 = time.perf_counter_ns()
        ok = engine.accept(m, t)
        t3 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"{engine.name}: the document's token {t} was refused")
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
    mask = engine.fill(m, buf)
    if not any(_allowed(buf if mask is None else mask, e) for e in eos):
        raise RuntimeError(f"{engine.name}: EOS not allowed after the complete document")
    return fills, accepts


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(name: str, tok, vocab: int, eos: list[int], doc_tokens: list[int], reps: int, walks: int) -> dict:
    result: dict = {"engine": name, **_import_cost(MODULES[name])}
    if "error" in result:
        return result
    from importlib.metadata import version

    result["version"] = version("llguidance" if name == "xpyd.model.grammar" else name)
    t = time.perf_counter()
    engine = CLASSES[name](tok, vocab, eos)
    result["tokenizer_ms"] = (time.perf_counter() - t) * 1e3
    words = (vocab + 31) // 32
    buf = np.zeros(words, dtype=np.int32)
    compiled: dict = {}
    result["compile_ms"] = {}
    for kind in KINDS:
        times = []
        for _ in range(reps if name != "outlines-core" or kind in ("regex", "choice") else 1):
            t = time.perf_counter()
            c = engine.compile(kind, _spec_value(kind))
            if c is None:
                break
            engine.fill(engine.matcher(c), buf)
            times.append((time.perf_counter() - t) * 1e3)
            compiled[kind] = c
        result["compile_ms"][kind] = statistics.median(times) if times else None
    made = []
    for _ in range(200):
        t = time.perf_counter_ns()
        engine.matcher(compiled["json_schema"])
        made.append(time.perf_counter_ns() - t)
    result["matcher_us"] = statistics.median(made) / 1e3
    result["walk"] = {}
    for kind in ("json_schema", "json_object"):
        t = time.perf_counter()
        _walk(engine, compiled[kind], doc_tokens, eos, words)  # the first request: lazy work (a cold cache) included
        first_ms = result["compile_ms"][kind] + (time.perf_counter() - t) * 1e3
        fills, accepts = [], []
        for _ in range(walks):
            f, a = _walk(engine, compiled[kind], doc_tokens, eos, words)
            fills += f
            accepts += a
        steps = [f + a for f, a in zip(fills, accepts)]
        result["walk"][kind] = {
            "tokens": len(doc_tokens), "first_request_ms": first_ms, "step_mean_us": statistics.fmean(steps) / 1e3,
            **{f"{what}_p{q}_us": _pct(v, q / 100) / 1e3 for what, v in
               (("step", steps), ("fill", fills), ("accept", accepts)) for q in (50, 99)},
        }
    return result


def _fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(results: list[dict]) -> str:
    head = ("| engine | import ms (torch?) | tokenizer info ms | compile ms: json_object / schema / regex / choice / "
            "grammar | matcher us | per token us, schema p50 / p99 / mean | "
            "per token us, json_object p50 / p99 / mean | "
            "first request ms, schema / json_object |")
    lines = [head, "|" + " --- |" * 8]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['engine']} | not installed: {r['error']} | | | | | | |")
            continue
        c = r["compile_ms"]
        s, o = r["walk"]["json_schema"], r["walk"]["json_object"]
        lines.append(
            f"| {r['engine']} {r['version']} | {_fmt(r['import_ms'], 0)} ({'yes' if r['imports_torch'] else 'no'}) | "
            f"{_fmt(r['tokenizer_ms'], 0)} | " + " / ".join(_fmt(c[k]) for k in KINDS)
            + f" | {_fmt(r['matcher_us'])} | "
            f"{_fmt(s['step_p50_us'])} / {_fmt(s['step_p99_us'])} / {_fmt(s['step_mean_us'])} | "
            f"{_fmt(o['step_p50_us'])} / {_fmt(o['step_p99_us'])} / {_fmt(o['step_mean_us'])} | "
            f"{_fmt(s['first_request_ms'])} / {_fmt(o['first_request_ms'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--reps", type=int, default=3, help="compilations per spec (outlines-core's JSON: 1)")
    ap.add_argument("--walks", type=int, default=5, help="walks of the document per grammar")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from xpyd.model.loader import ensure_converted

    folder = ensure_converted(None, progress=False).path
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    eos = [tok.eos_token_id]
    doc_tokens = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    print(f"tokenizer: {len(tok)} tokens, logits rows of {vocab}; document: {len(doc_tokens)} tokens; "
          f"{os.cpu_count()} CPUs", flush=True)
    results = []
    for name in args.engines.split(","):
        if name not in CLASSES:
            raise SystemExit(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
        t = time.perf_counter()
        results.append(measure(name, tok, vocab, eos, doc_tokens, args.reps, args.walks))
        print(f"{name}: measured in {time.perf_counter() - t:.1f} s", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": vocab, "tokenizer_len": len(tok), "document_tokens": len(doc_tokens),
                       "cpus": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
