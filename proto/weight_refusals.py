"""Why a weight update was refused, as both ends of the weight plane see it: the broker raises it, the
publisher's and subscriber's clients rebuild it from the ``ErrorDetail`` of a refusal."""

from __future__ import annotations

from primerl.proto.v1 import common_pb2


class WeightUpdateRefused(ValueError):
    """A weight update that was not accepted. ``code`` is an ``ErrorCode``; ``full_required`` says the
    sender must send a FULL (or LORA) update next."""

    def __init__(
        self, code: int, message: str, *, full_required: bool = False, retry_after_ms: int = 0, broker_lineage: int = 0
    ):
        super().__init__(message)
        self.code = code
        self.full_required = full_required
        self.retry_after_ms = retry_after_ms
        # The lineage the broker holds (from the refusal's WEIGHT_ACK; 0: unknown).
        self.broker_lineage = broker_lineage

    @property
    def code_name(self) -> str:
        return common_pb2.ErrorCode.Name(self.code)

    def detail(self) -> common_pb2.ErrorDetail:
        return common_pb2.ErrorDetail(code=self.code, message=self.args[0], retry_after_ms=self.retry_after_ms)

    @classmethod
    def from_detail(
        cls, detail: common_pb2.ErrorDetail, *, full_required: bool = False, broker_lineage: int = 0
    ) -> WeightUpdateRefused:
        return cls(
            detail.code,
            detail.message or common_pb2.ErrorCode.Name(detail.code),
            full_required=full_required,
            retry_after_ms=detail.retry_after_ms,
            broker_lineage=broker_lineage,
        )

    def __str__(self) -> str:
        return f"{self.code_name}: {self.args[0]}"


class LineageSuperseded(WeightUpdateRefused):
    """The broker holds a newer lineage than the sender's: a newer trainer incarnation replaced this one, which
    must stop publishing (it will never be accepted again)."""


__all__ = ["LineageSuperseded", "WeightUpdateRefused"]
