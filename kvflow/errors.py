"""Exceptions users catch."""


class EngineDeadError(RuntimeError):
    """The engine (EngineCore or a worker) is gone; pending and new requests fail with this."""
