"""The typed errors of broker calls: a subclass per HTTP status, problem details kept."""

from __future__ import annotations

import email.utils
import time
from typing import Any

from dejaq.client.connections import Response


class BrokerError(Exception):
    """Any failure of a broker call."""


class Unavailable(BrokerError):
    """No node served the call within its deadline (or it could not safely be retried)."""


class ProblemError(BrokerError):
    """An error answer, with its problem details (RFC 9457)."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str = "",
        type: str = "about:blank",
        extra: dict[str, Any] | None = None,
        maybe_applied: bool = False,
    ) -> None:
        super().__init__(f"{status} {title}: {detail}" if detail else f"{status} {title}")
        self.status, self.title, self.detail, self.type = status, title, detail, type
        self.extra = extra or {}
        self.maybe_applied = maybe_applied


class NotFound(ProblemError):
    """An unknown topic, message or route."""


class Conflict(ProblemError):
    """Some messages were refused; `refused` maps each id to why (or `reason`, for a
    single message's cancel or reschedule)."""

    @property
    def refused(self) -> dict[str, str]:
        return dict(self.extra.get("refused") or {})

    @property
    def settled(self) -> int:
        return int(self.extra.get("settled", 0))

    @property
    def reason(self) -> str | None:
        return self.extra.get("reason")


class Unauthorized(ProblemError):
    """No API key, or one no node knows (401): give `token`, or a valid one."""


class Forbidden(ProblemError):
    """The key lacks the role this call needs on this topic (403); `detail` names it."""


class PayloadTooLarge(ProblemError):
    """Over the broker's payload or request size limit."""


class InvalidRequest(ProblemError):
    """The request failed validation; `errors` names each field (`loc`) and why."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list(self.extra.get("errors") or [])


_BY_STATUS: dict[int, type[ProblemError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: InvalidRequest,
}


def problem_of(answer: Response, maybe_applied: bool = False) -> ProblemError:
    """The typed exception for an error answer (problem+json, or any other body)."""
    try:
        body = answer.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {"title": answer.reason_phrase, "detail": answer.text[:500]}
    fields = {k: body.get(k) for k in ("title", "detail", "type")}
    extra = {k: v for k, v in body.items() if k not in ("title", "detail", "type", "status")}
    cls = _BY_STATUS.get(answer.status_code, ProblemError)
    return cls(
        answer.status_code,
        str(fields["title"] or answer.reason_phrase),
        str(fields["detail"] or ""),
        str(fields["type"] or "about:blank"),
        extra,
        maybe_applied,
    )


def retry_after_s(answer: Response, default: float = 1.0) -> float:
    """`Retry-After` in seconds: delta-seconds or an HTTP date."""
    value = answer.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default
    return max(0.0, when.timestamp() - time.time())
