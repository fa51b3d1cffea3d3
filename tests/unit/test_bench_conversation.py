"""xpyd bench multi-turn: conversations whose turns carry the previous answers, and the runner that
drives them (a fake ``send``, no HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import pytest

from xpyd.bench.client import RequestResult
from xpyd.bench.config import config_from_args
from xpyd.bench.conversation import Conversation, MultiTurnConfig, build_conversations
from xpyd.bench.main import add_arguments
from xpyd.bench.runner import conversations
from xpyd.bench.workload import RequestSpec, TokenizerPromptBuilder, WordPromptBuilder


def _conv(chat: bool, turns: int = 3) -> Conversation:
    return Conversation(context="the long context", questions=tuple(f"question {k}" for k in range(1, turns + 1)),
                        think_s=tuple(0.5 * k for k in range(1, turns)), max_tokens=4, chat=chat, separator=" ")


def test_completions_transcript_grows_with_the_actual_answers():
    d = _conv(chat=False).dialogue()
    t1 = next(d)
    assert (t1.spec.prompt, t1.spec.turn, t1.think_s, t1.spec.max_tokens) == (
        "the long context question 1", 1, 0.0, 4)
    t2 = d.send(" answer one")
    assert t2.spec.prompt == "the long context question 1 answer one question 2"
    assert (t2.spec.turn, t2.think_s) == (2, 0.5)
    t3 = d.send("\nanswer two.")
    assert t3.spec.prompt == t2.spec.prompt + "\nanswer two." + " question 3"
    assert (t3.spec.turn, t3.think_s) == (3, 1.0)
    with pytest.raises(StopIteration):
        d.send(" last answer")


def test_chat_history_is_a_growing_messages_list():
    d = _conv(chat=True).dialogue()
    t1 = next(d)
    assert t1.spec.messages == ({"role": "user", "content": "the long context question 1"},)
    assert t1.spec.prompt is None
    t2 = d.send("A1")
    t3 = d.send("A2")
    assert t2.spec.messages[:1] == t1.spec.messages and t3.spec.messages[:3] == t2.spec.messages
    assert [m["role"] for m in t3.spec.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in t3.spec.messages[1:]] == ["A1", "question 2", "A2", "question 3"]


def test_a_dialogue_must_be_sent_text():
    d = _conv(chat=False).dialogue()
    next(d)
    with pytest.raises(TypeError, match="turn 1's answer"):
        d.send(None)


def test_build_conversations_shapes_and_seeds():
    b, shape = WordPromptBuilder(), MultiTurnConfig(conversations=3, turns=4, prefix_len=40, think_time_s=0.5)
    convs = build_conversations(b, shape, 6, 5, chat=False, seed=1)
    assert len(convs) == 3 and all(len(c.questions) == 4 and len(c.think_s) == 3 for c in convs)
    assert all(len(c.context.split()) == 40 and {len(q.split()) for q in c.questions} == {6} for c in convs)
    assert len({c.context for c in convs}) == 3 and {c.max_tokens for c in convs} == {5}
    assert convs == build_conversations(b, shape, 6, 5, chat=False, seed=1)
    assert convs != build_conversations(b, shape, 6, 5, chat=False, seed=2)
    first = next(convs[0].dialogue()).spec.prompt
    assert first.split() == convs[0].context.split() + convs[0].questions[0].split()
    shared = build_conversations(b, MultiTurnConfig(conversations=3, turns=2, prefix_len=40, shared_context=True),
                                 6, 5, chat=True, seed=1)
    assert len({c.context for c in shared}) == 1 and len({c.questions for c in shared}) == 3


def test_think_times_are_seeded_exponential_and_do_not_change_the_prompts():
    b = WordPromptBuilder()
    convs = build_conversations(b, MultiTurnConfig(conversations=200, turns=11, prefix_len=2, think_time_s=0.4),
                                1, 1, chat=False, seed=3)
    gaps = [t for c in convs for t in c.think_s]
    assert len(gaps) == 2000 and min(gaps) > 0
    assert statistics.mean(gaps) == pytest.approx(0.4, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.4, rel=0.15)  # exponential: stdev = mean
    none = build_conversations(b, MultiTurnConfig(conversations=200, turns=11, prefix_len=2, think_time_s=0),
                               1, 1, chat=False, seed=3)
    assert {t for c in none for t in c.think_s} == {0.0}
    assert [c.questions for c in none] == [c.questions for c in convs]


def test_first_turn_is_exact_with_a_tokenizer(smollm_dir):
    b = TokenizerPromptBuilder.from_path(smollm_dir)
    (conv,) = build_conversations(b, MultiTurnConfig(conversations=1, turns=2, prefix_len=100), 16, 4,
                                  chat=False, seed=0)
    d = conv.dialogue()
    assert b.count(next(d).spec.prompt) == 116
    assert b.count(d.send(" and so on").spec.prompt) == 116 + 3 + 16


@pytest.mark.parametrize("kw, match", [
    ({"conversations": 0}, ">= 1"), ({"turns": 0}, ">= 1"), ({"think_time_s": -1.0}, "--think-time"),
])
def test_multi_turn_config_is_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        MultiTurnConfig(**kw)


# ---- the runner ----------------------------------------------------------------------------------

class FakeServer:
    """``send``: answers after ``delay_s`` with a text unique to the request; fails turn ``fail_turn``
    of the conversation whose context is ``fail_context``."""

    def __init__(self, delay_s: float = 0.01, fail_context: str | None = None, fail_turn: int = 0) -> None:
        self.delay_s, self.fail_context, self.fail_turn = delay_s, fail_context, fail_turn
        self.sent: list[tuple[float, RequestSpec]] = []
        self.in_flight = self.max_in_flight = 0

    async def send(self, spec: RequestSpec) -> RequestResult:
        start = time.perf_counter()
        self.sent.append((start, spec))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        end = time.perf_counter()
        r = RequestResult(label="all", send_time=start, chunk_times=[end], end_time=end, turn=spec.turn,
                          text=f" answer{len(self.sent)}")
        if spec.prompt.startswith(str(self.fail_context)) and spec.turn == self.fail_turn:
            r.error = "http_500"
        return r


def _run(convs: list[Conversation], server: FakeServer, concurrency: int, duration_s: float | None = None):
    deadline = None if duration_s is None else time.perf_counter() + duration_s
    return asyncio.run(conversations(server.send, (c.dialogue() for c in convs), concurrency, deadline))


def _by_conversation(server: FakeServer, convs: list[Conversation]) -> list[list[tuple[float, RequestSpec]]]:
    return [[(t, s) for t, s in server.sent if s.prompt.startswith(c.context)] for c in convs]


def test_runner_feeds_each_answer_into_the_next_turn_and_waits_the_think_time():
    convs = build_conversations(WordPromptBuilder(), MultiTurnConfig(conversations=3, turns=3, prefix_len=20,
                                                                     think_time_s=0.03), 4, 2, chat=False, seed=0)
    server = FakeServer(delay_s=0.01)
    results = _run(convs, server, concurrency=2)
    assert len(results) == 9 and all(r.ok for r in results)
    assert server.max_in_flight == 2  # conversations in flight, each one request at a time
    by_result = {r.send_time: r for r in results}
    for conv, sent in zip(convs, _by_conversation(server, convs)):
        assert [s.turn for _, s in sent] == [1, 2, 3]
        for k in (1, 2):
            (t_prev, prev), (t_next, nxt) = sent[k - 1], sent[k]
            answer = by_result[t_prev].text
            assert nxt.prompt == prev.prompt + answer + " " + conv.questions[k]
            assert t_next - by_result[t_prev].end_time >= conv.think_s[k - 1] - 0.002


def test_a_failed_turn_ends_its_conversation_only():
    convs = build_conversations(WordPromptBuilder(), MultiTurnConfig(conversations=3, turns=4, prefix_len=20,
                                                                     think_time_s=0), 4, 2, chat=False, seed=0)
    server = FakeServer(fail_context=convs[1].context, fail_turn=2)
    results = _run(convs, server, concurrency=3)
    assert [len(s) for s in _by_conversation(server, convs)] == [4, 2, 4]
    assert len(results) == 10 and sum(not r.ok for r in results) == 1


def test_no_turn_is_sent_after_the_deadline():
    convs = build_conversations(WordPromptBuilder(), MultiTurnConfig(conversations=2, turns=50, prefix_len=5,
                                                                     think_time_s=0), 2, 2, chat=False, seed=0)
    server = FakeServer(delay_s=0.02)
    start = time.perf_counter()
    results = _run(convs, server, concurrency=2, duration_s=0.1)
    assert 4 <= len(results) <= 14 and time.perf_counter() - start < 0.5
    assert all(t < start + 0.1 + 0.01 for t, _ in server.sent)


def _config(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--url", "http://h:1", "--workload", "multi-turn", *argv]))


def test_multi_turn_cli_defaults():
    c = _config([])
    assert (c.multi_turn.conversations, c.multi_turn.turns, c.num_requests, c.effective_concurrency) == (4, 4, 16, 4)
    assert (c.multi_turn.prefix_len, c.input_len, c.output_len, c.multi_turn.think_time_s) == (512, 64, 32, 1.0)
    c = _config(["--concurrency", "3", "--turns", "2"])  # conversations default to the concurrency
    assert (c.multi_turn.conversations, c.num_requests, c.effective_concurrency) == (3, 6, 3)
    c = _config(["--conversations", "6", "--concurrency", "2", "--num-requests", "24", "--shared-context"])
    assert (c.num_requests, c.effective_concurrency, c.max_connections, c.multi_turn.shared_context) == (
        24, 2, 2, True)
    assert c.describe()["multi_turn"]["think_time"] == "exponential"
