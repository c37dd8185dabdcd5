"""The delivery queue: each attempt is a row. A process claims a due row with a conditional UPDATE
(queued → sending), sends with no transaction open, records the outcome on the row, and queues the next
attempt (a new row) after a temporary failure, with exponential backoff or the server's Retry-After."""

from __future__ import annotations

import logging
import random
from datetime import datetime, timedelta

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import models
from ampwatch.server.alerts._channels import Outcome, send
from ampwatch.server.alerts._db import WAKE, now
from ampwatch.server.alerts._messages import Notice, notice_for_flip, test_notice

log = logging.getLogger("ampwatch.alerts")
D = models.AlertDelivery
MAX_ATTEMPTS = 8
STALE_S = 300.0  # a 'sending' row older than this lost its process: try again


def claim_due(session: Session, *, stamp: datetime, limit: int) -> list[int]:
    """Claim up to `limit` due deliveries for this process; each is claimed by exactly one process."""
    due = session.scalars(select(D.id).where(D.status == "queued", D.due_at <= stamp).order_by(D.due_at).limit(limit)).all()
    mine = []
    for delivery_id in due:
        done = session.execute(
            update(D).where(D.id == delivery_id, D.status == "queued").values(status="sending", claimed_at=stamp)
            .execution_options(synchronize_session=False)
        )  # fmt: skip
        if done.rowcount == 1:
            mine.append(delivery_id)
    session.commit()
    return mine


def attempt(
    sessions: sessionmaker[Session], delivery_id: int, *, base_url: str, timeout_s: float, http: httpx.Client | None = None
) -> Outcome:
    """Send one claimed delivery and record what happened."""
    with sessions() as session:
        delivery = session.get(D, delivery_id)
        channel = session.get(models.AlertChannel, delivery.channel_id) if delivery else None
        if delivery is None or channel is None:
            return Outcome(False, error="the delivery or its channel was deleted")
        flip = session.get(models.AlertFlip, delivery.flip_id) if delivery.flip_id is not None else None
        notice = notice_for_flip(session, flip, base_url) if flip else test_notice(channel, base_url)
    outcome = send(channel, notice, timeout_s=timeout_s, http=http)
    with sessions() as session:
        record(session, delivery_id, outcome, stamp=now())
        session.commit()
    if not outcome.ok:
        log.warning("alert delivery %d (attempt to channel %r) failed: %s", delivery_id, channel.name, outcome.error)
    return outcome


def record(session: Session, delivery_id: int, outcome: Outcome, *, stamp: datetime) -> None:
    """Store the outcome on the attempt's row; queue the next attempt after a temporary failure."""
    delivery = session.get(D, delivery_id)
    assert delivery is not None
    delivery.finished_at, delivery.response_status, delivery.error = stamp, outcome.status, outcome.error
    if outcome.ok:
        delivery.status = "delivered"
    elif outcome.temporary and delivery.attempt < MAX_ATTEMPTS and delivery.flip_id is not None:
        delivery.status = "retried"
        _requeue(session, delivery, stamp, outcome.retry_after_s)
    else:
        delivery.status = "failed"
        if outcome.temporary and delivery.flip_id is not None:
            delivery.error = f"{outcome.error} (gave up after {delivery.attempt} attempts)"


def _requeue(session: Session, delivery: models.AlertDelivery, stamp: datetime, retry_after_s: float | None) -> None:
    backoff = min(600.0, 2.0 ** (delivery.attempt - 1)) * random.uniform(0.8, 1.2)
    delay = retry_after_s if retry_after_s is not None else backoff
    session.add(D(
        flip_id=delivery.flip_id, channel_id=delivery.channel_id, attempt=delivery.attempt + 1, status="queued",
        due_at=stamp + timedelta(seconds=delay), created_at=stamp, claimed_at=None, finished_at=None,
        response_status=None, error=None,
    ))  # fmt: skip
    session.info[WAKE] = True


def recover_stale(session: Session, *, stamp: datetime) -> int:
    """Attempts claimed by a process that died before recording an outcome are retried."""
    cutoff = stamp - timedelta(seconds=STALE_S)
    stale = session.scalars(select(D.id).where(D.status == "sending", D.claimed_at < cutoff).limit(100)).all()
    for delivery_id in stale:
        done = session.execute(
            update(D).where(D.id == delivery_id, D.status == "sending").values(status="claimed")
            .execution_options(synchronize_session=False)
        )  # fmt: skip
        if done.rowcount == 1:
            record(session, delivery_id, Outcome(False, temporary=True, error="the sending process stopped without an outcome"), stamp=stamp)
    session.commit()
    return len(stale)


def send_test(session: Session, channel: models.AlertChannel, *, base_url: str, timeout_s: float) -> tuple[models.AlertDelivery, Notice]:
    """Send a test notification now and record it as a delivery without retries."""
    notice = test_notice(channel, base_url)
    outcome = send(channel, notice, timeout_s=timeout_s)
    stamp = now()
    delivery = D(flip_id=None, channel_id=channel.id, attempt=1, status="delivered" if outcome.ok else "failed",
                 due_at=stamp, created_at=stamp, claimed_at=stamp, finished_at=stamp,
                 response_status=outcome.status, error=outcome.error)  # fmt: skip
    session.add(delivery)
    session.commit()
    return delivery, notice
