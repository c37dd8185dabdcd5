"""Server-Sent Events on the wire, for the live streams (`ampwatch.server.routers.stream`): a message is encoded
once and the same bytes are written to every connection of its topic; a stream waits on its topic's subscription
(`ampwatch.server.fanout`) and keeps an idle connection open with a comment line."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from fastapi.sse import KEEPALIVE_COMMENT, ServerSentEvent, format_sse_event

from ampwatch.server import fanout

RETRY_MS = 500  # a stream's first message tells its browser to reconnect this soon after it ends
PING_S = 15.0  # a comment line after this long without a message keeps proxies from closing an idle stream
SSE_DOC: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}  # a route's OpenAPI answer


class SSEResponse(StreamingResponse):
    """Server-Sent Events written straight to the connection: a message a poller encoded once is the same bytes
    for every stream of its topic, and each message is one `send` (FastAPI's EventSourceResponse encodes per
    connection and passes each message through two tasks and two queues: several times the CPU per open tab)."""

    media_type = "text/event-stream"

    def __init__(self, messages: AsyncIterator[ServerSentEvent | bytes]) -> None:
        super().__init__(
            (m if isinstance(m, bytes) else encode(m) async for m in messages),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},  # (nginx: do not buffer)
        )


def encode(message: ServerSentEvent) -> bytes:
    """The message as it goes on the wire."""
    return format_sse_event(
        data_str=message.raw_data, event=message.event, id=message.id, retry=message.retry, comment=message.comment
    )


def sse_id(message: bytes) -> str:
    """The id line of an encoded message ('' when it has none)."""
    for line in message.split(b"\n"):
        if line.startswith(b"id:"):
            return line[3:].strip().decode()
    return ""


async def shared(subscription: fanout.Subscription, deadline: float) -> AsyncIterator[Any]:
    """The topic's messages until the stream's deadline (`time.monotonic()`), or until it falls too far behind
    (dropped); a ping comment after PING_S without one."""
    quiet_since = time.monotonic()
    while not subscription.dropped and (left := deadline - time.monotonic()) > 0:
        messages = await subscription.get(min(left, PING_S))
        for message in messages:
            yield message
        if messages:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= PING_S and not subscription.dropped:
            yield KEEPALIVE_COMMENT
            quiet_since = time.monotonic()
