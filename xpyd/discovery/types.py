"""What a worker tells the world about itself (also the etcd value in dynamic mode)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    role: Role
    http_url: str  # e.g. http://127.0.0.1:8100
    signal_addr: str  # host:port of the ZMQ signal plane
    model_id: str  # served model name
    protocol_version: int
    capacity: int  # batch size (max running + transferring)

    def to_json(self) -> str:
        d = asdict(self)
        d["role"] = self.role.value
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "WorkerInfo":
        try:
            return cls(
                role=Role(d["role"]),
                http_url=str(d["http_url"]),
                signal_addr=str(d["signal_addr"]),
                model_id=str(d["model_id"]),
                protocol_version=int(d["protocol_version"]),
                capacity=int(d["capacity"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid worker info: {e}") from e

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerInfo":
        return cls.from_dict(json.loads(text))
