"""The error every API layer raises for a request it refuses: it becomes an OpenAI-style JSON error."""

from __future__ import annotations


class APIError(Exception):
    """An error that becomes an OpenAI-style error response with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
