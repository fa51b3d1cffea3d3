"""What every role's engine holds and how requests reach it."""

from __future__ import annotations

from dataclasses import dataclass

from xpyd.discovery.types import WorkerInfo
from xpyd.worker.config import WorkerConfig
from xpyd.worker.loop import EngineThread
from xpyd.worker.metrics import WorkerMetrics
from xpyd.worker.work_item import WorkItem


@dataclass(frozen=True, slots=True)
class Abort:
    """Posted to the engine thread: drop this request wherever it is."""

    request_id: str


class WorkerEngine(EngineThread):
    """The model runner, its KV pool, the tokenizer, config and metrics; ``submit``/``abort`` from HTTP."""

    def __init__(self, runner, tokenizer, config: WorkerConfig, served_name: str) -> None:
        super().__init__()
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.pool = runner.pool
        self.max_model_len: int = runner.max_model_len
        self.eos_token_ids: frozenset[int] = runner.eos_token_ids
        self.model_id = served_name
        self.metrics = WorkerMetrics(config.role)
        self.info: WorkerInfo | None = None

    def submit(self, item: WorkItem) -> None:
        self.post(item)

    def abort(self, request_id: str) -> None:
        self.post(Abort(request_id))
