"""The error an endpoint raises for a request it cannot serve; the app turns it into its API's error shape."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param
        self.headers = headers or {}
