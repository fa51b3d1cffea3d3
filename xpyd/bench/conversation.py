"""Multi-turn conversations: requests that depend on the server's previous answers.

A ``Conversation`` holds everything that can be drawn up front (the long first context, one question
per turn, the think times between turns); what it cannot know is the server's answers. Its
``dialogue()`` is a generator that yields the next ``Turn`` and is sent the answer text of the
previous one::

    dialogue = conversation.dialogue()
    turn = next(dialogue)                # turn 1: context + first question
    turn = dialogue.send(answer_text)    # turn 2: the history so far + that answer + question 2
    ...                                  # StopIteration after the last turn

so the history grows with the ACTUAL answers, and the runner (``runner.conversations``) only drives
generators: wait ``turn.think_s``, send ``turn.spec``, feed back the result's text. Chat endpoint: a
messages list (user, assistant, user, ...); completions endpoint: the transcript as one prompt
(first user message, answer, next question, answer, ...), each question joined with the prompt
builder's separator, each answer appended exactly as streamed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generator

from xpyd.bench.workload import PromptBuilder, RequestSpec


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """The multi-turn workload: ``conversations`` conversations of ``turns`` turns; the first user
    message is a context of ``prefix_len`` tokens (the conversation's own, or one for all with
    ``shared_context``) followed by a question of --input-len tokens; every later user message is a
    question of --input-len tokens. Between two turns a conversation pauses for a think time drawn
    from an exponential distribution with mean ``think_time_s`` (0: no pause)."""

    conversations: int = 4
    turns: int = 4
    prefix_len: int = 512
    shared_context: bool = False
    think_time_s: float = 1.0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1 or self.prefix_len < 1:
            raise ValueError("--conversations, --turns and --prefix-len must be >= 1")
        if not self.think_time_s >= 0:
            raise ValueError(f"--think-time must be >= 0, got {self.think_time_s}")


@dataclass(frozen=True, slots=True)
class Turn:
    spec: RequestSpec
    think_s: float  # pause after the previous answer before sending this turn (0.0 for the first)


Dialogue = Generator[Turn, str, None]  # yields the next turn; is sent the previous turn's answer


@dataclass(frozen=True, slots=True)
class Conversation:
    context: str
    questions: tuple[str, ...]  # one per turn
    think_s: tuple[float, ...]  # before turns 2..T
    max_tokens: int
    chat: bool
    separator: str  # the prompt builder's: joins the context and a question to what precedes them

    def __post_init__(self) -> None:
        if not self.questions or len(self.think_s) != len(self.questions) - 1:
            raise ValueError("a conversation has at least one turn and a think time before each later one")

    def dialogue(self) -> Dialogue:
        history = [("user", self.context + self.separator + self.questions[0])]
        think = (0.0, *self.think_s)
        for k, question in enumerate(self.questions):
            if k:
                history += [("assistant", answer), ("user", question)]
            answer = yield Turn(self._request(history, k + 1), think[k])
            if not isinstance(answer, str):
                raise TypeError(f"send the text of turn {k + 1}'s answer, got {type(answer).__name__}")

    def _request(self, history: list[tuple[str, str]], turn: int) -> RequestSpec:
        if self.chat:
            messages = tuple({"role": role, "content": text} for role, text in history)
            return RequestSpec(messages=messages, max_tokens=self.max_tokens, turn=turn)
        prompt = "".join(text if role == "assistant" or i == 0 else self.separator + text
                         for i, (role, text) in enumerate(history))
        return RequestSpec(prompt=prompt, max_tokens=self.max_tokens, turn=turn)


def build_conversations(builder: PromptBuilder, shape: MultiTurnConfig, input_len: int, output_len: int,
                        chat: bool, seed: int) -> list[Conversation]:
    """The conversations of a run: texts from ``random.Random(seed)``, think times from
    ``random.Random(seed + 2)`` (so a different --think-time does not change the prompts)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng, think_rng = random.Random(seed), random.Random(seed + 2)
    shared = builder.build(shape.prefix_len, rng) if shape.shared_context else None
    out = []
    for _ in range(shape.conversations):
        context = shared if shared is not None else builder.build(shape.prefix_len, rng)
        questions = tuple(builder.build(input_len, rng) for _ in range(shape.turns))
        think = tuple(think_rng.expovariate(1.0 / shape.think_time_s) if shape.think_time_s > 0 else 0.0
                      for _ in range(shape.turns - 1))
        out.append(Conversation(context, questions, think, output_len, chat, builder.separator))
    return out
