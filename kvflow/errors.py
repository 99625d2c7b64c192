"""Exceptions users catch."""


class EngineDeadError(RuntimeError):
    """The engine (EngineCore or a worker) is gone; pending and new requests fail with this.
    `request_ids`: the requests of the step it died in, when that is known."""

    def __init__(self, message: str | None = "", request_ids: list[str] | None = None) -> None:
        super().__init__(message or "")
        self.request_ids = request_ids or []


class EngineOverloadedError(RuntimeError):
    """Too many requests already wait for the engine (the server's --max-waiting-requests):
    retry later. Raised at once, before the request is tokenized or queued."""
