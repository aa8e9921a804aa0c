"""OpenAI-shaped JSON errors, shared by the app (server.py) and the handlers (serving*.py).

A module of its own so that the handlers can raise APIError without importing server.py, which imports them.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from pressroom.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)
