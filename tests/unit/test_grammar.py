"""Structured output's grammar layer (xpyd.model.grammar, grammar_torch) on SmolLM2's tokenizer: walks of valid
outputs, refusals that leave the state alone, masks that agree with accept, EOS, padded vocabularies, the cache,
compile errors, and an import that stays torch-free."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from xpyd.model.grammar import GrammarError, Grammars, GrammarSpec, mask_allows, mask_tokens
from xpyd.tokenization.tokenizer import LightTokenizer

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "status": {"enum": ["active", "inactive"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "address"],
    "additionalProperties": False,
}
LARK = 'start: "SELECT " cols " FROM " ident ";"\ncols: "*" | ident (", " ident)*\nident: /[a-z_][a-z0-9_]*/\n'
GBNF = 'root ::= "SELECT " cols " FROM " ident ";"\ncols ::= "*" | ident (", " ident)*\nident ::= [a-z_] [a-z0-9_]*\n'
# (spec, a valid output)
WALKS = {
    "json_object": (GrammarSpec("json_object", ""), '{"a": [1, 2.5, {"b": null}], "c": "x y"}'),
    "json_schema": (GrammarSpec("json_schema", json.dumps(SCHEMA)),
                    json.dumps({"name": "Ada", "age": 36, "status": "active", "tags": ["math", "poet"],
                                "address": {"city": "London"}})),
    "regex": (GrammarSpec("regex", r"\d{3}-\d{4}"), "555-1234"),
    "choice": (GrammarSpec("choice", json.dumps(["positive", "negative", "neutral", "mixed"])), "neutral"),
    "grammar-lark": (GrammarSpec("grammar", LARK), "SELECT name, age FROM people;"),
    "grammar-gbnf": (GrammarSpec("grammar", GBNF), "SELECT * FROM people;"),
}


@pytest.fixture(scope="module")
def tok(smollm_dir) -> LightTokenizer:
    return LightTokenizer.from_folder(smollm_dir)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, VOCAB, frozenset({EOS}))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("case", list(WALKS))
def test_a_valid_output_walks_to_a_terminated_grammar(grammars, tok, case):
    spec, text = WALKS[case]
    m = grammars.matcher(spec)
    for i, t in enumerate(_ids(tok, text)):
        mask = m.allowed()
        assert not mask_allows(mask, EOS), f"EOS allowed after {i} of {text!r}"
        assert mask_allows(mask, t), f"token {i} of {text!r} not in the mask"
        assert not m.is_terminated()
        assert m.accept(t), f"token {i} of {text!r} refused"
    assert m.is_terminated()
    assert mask_tokens(m.allowed()) == [EOS]  # complete: only EOS
    assert m.accept(EOS) and m.is_terminated()


def test_eos_is_allowed_exactly_when_the_output_is_complete(grammars, tok):
    m = grammars.matcher(GrammarSpec("regex", r"\d+"))
    assert not mask_allows(m.allowed(), EOS)  # nothing yet
    assert m.accept(_ids(tok, "7")[0])
    mask = m.allowed()
    assert mask_allows(mask, EOS) and mask_allows(mask, _ids(tok, "8")[0])  # complete, and may go on
    assert not m.is_terminated()


def test_every_eos_id_is_allowed_when_terminated(tok):
    g = Grammars(tok, VOCAB, frozenset({EOS, 0}))
    m = g.matcher(GrammarSpec("choice", '["yes"]'))
    for t in _ids(tok, "yes"):
        assert m.accept(t)
    assert mask_tokens(m.allowed()) == [0, EOS]


@pytest.mark.parametrize("case", list(WALKS))
def test_a_refused_token_leaves_the_state_unchanged(grammars, tok, case):
    spec, text = WALKS[case]
    ids = _ids(tok, text)
    m = grammars.matcher(spec)
    half = len(ids) // 2
    for t in ids[:half]:
        assert m.accept(t)
    before = m.allowed()
    refused = [t for t in range(VOCAB) if not mask_allows(before, t)][::997] + [-1, VOCAB, VOCAB + 5]
    for t in refused:
        assert not m.accept(t), t
        assert m.allowed() == before
    for t in ids[half:]:  # the valid output still completes
        assert m.accept(t)
    assert m.is_terminated()


@pytest.mark.parametrize("case", list(WALKS))
def test_the_mask_allows_exactly_what_accept_accepts(grammars, tok, case):
    spec, text = WALKS[case]
    ids = _ids(tok, text)
    rng = random.Random(case)
    checked_allowed = 0
    for step in sorted({0, 1, len(ids) // 2, len(ids) - 1, len(ids)}):
        m = grammars.matcher(spec)
        for t in ids[:step]:
            assert m.accept(t)
        mask = m.allowed()
        allowed = mask_tokens(mask)
        sample = [rng.randrange(VOCAB) for _ in range(200)] + rng.sample(allowed, min(20, len(allowed)))
        for t in sample:
            twin = m.fork()
            assert twin.accept(t) == mask_allows(mask, t), (step, t)
            checked_allowed += mask_allows(mask, t)
        assert m.allowed() == mask  # the forks left the original alone
    assert checked_allowed > 0


def _valid(doc, schema) -> bool:
    """A validator for what SCHEMA uses: object (properties, required, additionalProperties false), string,
    integer with minimum, enum, array of items."""
    if "enum" in schema:
        return doc in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(doc, dict) and set(schema.get("required", ())) <= doc.keys() <= props.keys()
                and all(_valid(v, props[k]) for k, v in doc.items()))
    if kind == "array":
        return isinstance(doc, list) and all(_valid(v, schema["items"]) for v in doc)
    if kind == "string":
        return isinstance(doc, str)
    if kind == "integer":
        return type(doc) is int and doc >= schema.get("minimum", doc)
    raise AssertionError(f"the validator does not know {kind}")


def test_required_fields_are_never_skipped(grammars, tok):
    # close whatever may be closed (a string, then an object or array) as early as the grammar lets it; else the
    # lowest allowed id
    prefer = [_ids(tok, s)[0] for s in ('"', "}", "]", ",", "0", "[")]
    assert len(set(prefer)) == len(prefer)
    m = grammars.matcher(WALKS["json_schema"][0])
    out: list[int] = []
    for _ in range(200):
        mask = m.allowed()
        if mask_allows(mask, EOS):
            break
        t = next((p for p in prefer if mask_allows(mask, p)), None)
        t = mask_tokens(mask)[0] if t is None else t
        assert m.accept(t)
        out.append(t)
    assert m.is_terminated(), tok.decode(out)
    doc = json.loads(tok.decode(out))
    assert _valid(doc, SCHEMA), doc
    assert set(doc) >= {"name", "age", "status", "address"} and "city" in doc["address"]
    assert not _valid({"name": "", "age": 0, "status": "active"}, SCHEMA)  # the validator can say no


def test_a_json_schema_object_cannot_close_before_its_required_fields(grammars, tok):
    m = grammars.matcher(WALKS["json_schema"][0])
    assert m.accept(_ids(tok, "{")[0])
    closing = [t for t in range(VOCAB) if "}" in tok.decode([t])]
    assert closing and not any(mask_allows(m.allowed(), t) for t in closing)


def test_fork_is_independent(grammars, tok):
    spec, text = WALKS["choice"]
    m = grammars.matcher(spec)
    twin = m.fork()
    for t in _ids(tok, text):
        assert twin.accept(t)
    assert twin.is_terminated() and not m.is_terminated()
    assert not mask_allows(m.allowed(), EOS)
    pos = _ids(tok, "positive")
    assert m.accept(pos[0])


def test_padded_logits_rows_are_never_allowed(tok):
    padded = VOCAB + 40
    g = Grammars(tok, padded, frozenset({EOS}))
    m = g.matcher(GrammarSpec("json_object", ""))
    assert m.accept(_ids(tok, "{")[0]) and m.accept(_ids(tok, '"')[0])
    mask = m.allowed()
    assert len(mask) == (padded + 31) // 32 * 4
    assert len(mask_tokens(mask)) > 1000  # a free string: almost anything
    assert not any(mask_allows(mask, t) for t in range(VOCAB, padded))
    assert not m.accept(VOCAB) and not m.accept(padded - 1)


def test_a_tokenizer_larger_than_the_logits_row_is_cut(tok):
    small = 49000  # the tokenizer has 49,152 ids
    g = Grammars(tok, small, frozenset({EOS}))
    m = g.matcher(GrammarSpec("json_object", ""))
    assert m.accept(_ids(tok, "{")[0]) and m.accept(_ids(tok, '"')[0])
    mask = m.allowed()
    assert len(mask) == (small + 31) // 32 * 4
    assert max(mask_tokens(mask)) < small
    wide = Grammars(tok, VOCAB, frozenset({EOS})).matcher(GrammarSpec("json_object", ""))
    assert wide.accept(_ids(tok, "{")[0]) and wide.accept(_ids(tok, '"')[0])
    assert any(t >= small for t in mask_tokens(wide.allowed()))  # there was something to cut
    assert not m.accept(small + 10)


def test_apply_mask_sets_disallowed_logits_to_minus_infinity(grammars, tok):
    torch = pytest.importorskip("torch")
    from xpyd.model.grammar_torch import apply_mask, apply_masks

    m = grammars.matcher(GrammarSpec("json_object", ""))
    m.accept(_ids(tok, "{")[0])
    mask = m.allowed()
    allowed = torch.tensor([mask_allows(mask, t) for t in range(VOCAB)])
    assert 0 < int(allowed.sum()) < VOCAB
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    before = row.clone()
    assert apply_mask(row, mask) is row
    assert torch.equal(row[allowed], before[allowed])
    assert bool(torch.isneginf(row[~allowed]).all())
    # a batch: a row without a mask is left alone; a row wider than the mask loses its extra ids
    rows = torch.randn(3, VOCAB + 7, generator=torch.Generator().manual_seed(1))
    kept = rows.clone()
    apply_masks(rows, [mask, None, mask])
    assert torch.equal(rows[1], kept[1])
    for i in (0, 2):
        assert torch.equal(rows[i, :VOCAB][allowed], kept[i, :VOCAB][allowed])
        assert bool(torch.isneginf(rows[i, :VOCAB][~allowed]).all()) and bool(torch.isneginf(rows[i, VOCAB:]).all())
    with pytest.raises(ValueError, match="one length"):
        apply_masks(torch.zeros(2, VOCAB), [mask, mask[:-4]])


@pytest.mark.parametrize("kind, value, message", [
    ("regex", "(", "(?s)regex: .*unclosed group"),
    ("regex", "", "regex: empty"),
    ("json_schema", '{"type": "object",', "json_schema: not valid JSON"),
    ("json_schema", "[1]", "json_schema: a schema is a JSON object"),
    ("json_schema", '{"type": "objekt"}', "json_schema: .*objekt"),
    ("choice", "[]", "choice: expected a non-empty JSON list"),
    ("choice", '["a", 1]', "choice: expected a non-empty JSON list"),
    ("grammar", "root ::= missing", "grammar: .*missing"),
    ("grammar", "start: (", "grammar: "),
])
def test_a_spec_that_does_not_compile_is_a_grammar_error(grammars, kind, value, message):
    with pytest.raises(GrammarError, match=message):
        grammars.compile(GrammarSpec(kind, value))


@pytest.mark.parametrize("kind, value, message", [
    ("xml", "", "unknown grammar kind 'xml'"),
    ("json_object", "{}", "json_object: takes no value"),
    ("regex", 5, "regex: the value must be a string"),
])
def test_a_malformed_spec_is_a_grammar_error(kind, value, message):
    with pytest.raises(GrammarError, match=message):
        GrammarSpec(kind, value)
    assert issubclass(GrammarError, ValueError)


def test_the_cache_returns_one_compiled_grammar_per_spec_and_is_bounded(tok):
    g = Grammars(tok, VOCAB, frozenset({EOS}), cache_size=2)
    a, b, c = (GrammarSpec("regex", r) for r in (r"\d+", "[a-z]+", "x|y"))
    first = g.compile(a)
    assert g.compile(GrammarSpec("regex", r"\d+")) is first  # an equal spec
    hash(a)  # hashable
    second = g.compile(b)
    assert g.compile(a) is first  # a is now the most recent
    g.compile(c)  # evicts b, the least recently used
    assert g.compile(a) is first
    assert g.compile(b) is not second
    assert len(g._cache) == 2
    m1, m2 = first.matcher(), first.matcher()  # matchers from one compiled grammar are independent
    assert m1.accept(_ids(tok, "1")[0])
    assert not mask_allows(m2.allowed(), EOS) and mask_allows(m1.allowed(), EOS)


def test_importing_the_grammar_module_imports_no_torch():
    code = ("import sys, xpyd.model.grammar; "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
