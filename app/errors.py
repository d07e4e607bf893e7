"""Client errors in OpenAI's error shape. Anything raised as ClientError becomes a 4xx, never a 500."""

from __future__ import annotations


class ClientError(Exception):
    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Overloaded(ClientError):
    """No room now (a full queue): 503 with Retry-After, which clients and the batch driver retry."""

    def __init__(self, message: str = "the server is at capacity; retry shortly", retry_after_s: int = 1):
        super().__init__(message, status=503, type="server_busy", code="overloaded",
                         headers={"Retry-After": str(retry_after_s)})


class Unavailable(ClientError):
    """This replica can serve nothing more (a tensor-parallel group that lost step is being replaced):
    503 with Retry-After; the client's retry meets a healthy replica or the replaced one."""

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message, status=503, type="server_error", code="replica_failed",
                         headers={"Retry-After": str(retry_after_s)})
