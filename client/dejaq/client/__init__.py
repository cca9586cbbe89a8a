"""DejaQ's worker client: the broker's HTTP API as typed calls, and a worker loop over it.

Its own small distribution (`dejaq-client`, whose one dependency is httptools, the C
HTTP parser): a worker installs it without Spark, NumPy or pyarrow.
"""

from dejaq.client.api import Client
from dejaq.client.errors import (
    BrokerError,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ProblemError,
    Unauthorized,
    Unavailable,
)
from dejaq.client.models import Message, NewMessage
from dejaq.client.worker import Backoff, Worker

__all__ = [
    "Backoff",
    "BrokerError",
    "Client",
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "Message",
    "NewMessage",
    "NotFound",
    "PayloadTooLarge",
    "ProblemError",
    "Unauthorized",
    "Unavailable",
    "Worker",
]
