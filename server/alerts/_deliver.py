"""The delivery queue: each attempt is a row. A process claims a due row with a conditional UPDATE
(queued → sending), sends with no transaction open, records the outcome on the row, and queues the next
attempt (a new row) after a temporary failure, with exponential backoff or the server's Retry-After."""

from __future__ import annotations

import logging
import random
from datetime import datetime, timedelta
from typing import Any, cast

import httpx
from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker

from ampwatch.server import models
from ampwatch.server.alerts._channels import Outcome, send
from ampwatch.server.alerts._db import WAKE, now, utc
from ampwatch.server.alerts._messages import Notice, grouped, notice_for_flip, test_notice

log = logging.getLogger("ampwatch.alerts")
D = models.AlertDelivery
RETRY_FOR = timedelta(hours=24)  # a notification is retried (every 10 min at most) until a day after its flip
STALE_SENDS = 3  # a 'sending' row claimed this many delivery timeouts ago (a minute at least) lost its process
_GROUP_MAX = 20  # alerts in one message at most


def claim_due(session: Session, *, stamp: datetime, limit: int, group_wait_s: float = 0.0) -> list[list[int]]:
    """Claim up to `limit` groups of due deliveries for this process; each row is claimed by exactly one
    process. A group is one channel's notifications about one run: one message. A group goes out once its
    first notification has waited `group_wait_s` (Alertmanager's group_wait), with whatever joined it since."""
    F, A = models.AlertFlip, models.Alert
    waited = stamp - timedelta(seconds=group_wait_s)
    query = (
        select(D.id, D.channel_id, A.run_id, F.old_state, F.new_state, D.attempt, D.due_at)
        .outerjoin(F, F.id == D.flip_id)
        .outerjoin(A, A.id == F.alert_id)
        .where(D.status == "queued", D.due_at <= stamp)
        .order_by(D.due_at, D.id)
        .limit(limit * _GROUP_MAX * 4)
    )
    rows = session.execute(query).all()
    held = _resolves_held(session, [r.id for r in rows if r.new_state == "resolved"])
    keyed = [(_group_key(r), r) for r in rows if r.id not in held]
    ready = {key for key, r in keyed if r.attempt > 1 or utc(r.due_at) <= waited}
    groups: dict[tuple[Any, ...], list[int]] = {}
    for key, row in keyed:
        if key not in ready or (key not in groups and len(groups) >= limit) or len(groups.get(key, ())) >= _GROUP_MAX:
            continue
        done = session.execute(
            update(D)
            .where(D.id == row.id, D.status == "queued")
            .values(status="sending", claimed_at=stamp)
            .execution_options(synchronize_session=False)
        )
        if cast(CursorResult[Any], done).rowcount == 1:
            groups.setdefault(key, []).append(row.id)
    session.commit()
    return list(groups.values())


def _resolves_held(session: Session, resolved_ids: list[int]) -> set[int]:
    """Resolved notices whose alert's firing notice, to the same channel, is still on its first attempt: a
    receiver (Alertmanager, a pager) that never saw the alert fire would drop the resolve, so it waits."""
    if not resolved_ids:
        return set()
    F, mine, theirs, their_flip = models.AlertFlip, D, aliased(D), aliased(models.AlertFlip)
    query = (
        select(mine.id)
        .join(F, F.id == mine.flip_id)
        .where(mine.id.in_(resolved_ids))
        .where(
            select(theirs.id)
            .join(their_flip, their_flip.id == theirs.flip_id)
            .where(
                their_flip.alert_id == F.alert_id,
                their_flip.new_state == "firing",
                their_flip.id < F.id,
                theirs.channel_id == mine.channel_id,
                theirs.attempt == 1,
                theirs.status.in_(("queued", "sending")),
            )
            .exists()
        )
    )
    return set(session.scalars(query))


def _group_key(row: Any) -> tuple[Any, ...]:
    kind = "reminder" if row.old_state == row.new_state == "firing" else row.new_state
    return (row.channel_id, row.run_id, kind) if row.run_id is not None else (row.id,)


def attempt(
    sessions: sessionmaker[Session],
    delivery_ids: list[int],
    *,
    base_url: str,
    timeout_s: float,
    scope: str = "private",
    http: httpx.Client | None = None,
) -> Outcome:
    """Send claimed deliveries (one channel, one run) as one message and record what happened on each."""
    with sessions() as session:
        deliveries = [d for d in (session.get(D, i) for i in delivery_ids) if d is not None]
        channel = session.get(models.AlertChannel, deliveries[0].channel_id) if deliveries else None
        if channel is None:
            return Outcome(False, error="the delivery or its channel was deleted")
        flips = {d.id: session.get(models.AlertFlip, d.flip_id) for d in deliveries if d.flip_id is not None}
        stale = [d for d in deliveries if _superseded(session, d, flips.get(d.id))]
        if stale:  # a retried "firing" must not arrive after the "resolved" that followed it
            for delivery in stale:
                delivery.status, delivery.finished_at = "superseded", now()
                delivery.error = "not sent: the alert resolved before this notification could be delivered"
            session.commit()
            deliveries = [d for d in deliveries if d not in stale]
            if not deliveries:
                return Outcome(True)
        notices = [notice_for_flip(session, f, base_url) for d in deliveries if (f := flips.get(d.id)) is not None]
        notice = grouped(notices) if notices else test_notice(channel, base_url)
    if channel.enabled:  # (a retry, or a send again after a restart mid-send, carries the same key)
        key = "ampwatch-" + "-".join(str(d.flip_id) for d in deliveries) + f"-{channel.id}" if flips else None
        outcome = send(channel, notice, timeout_s=timeout_s, scope=scope, http=http, key=key)
    else:  # disabled after this was queued (a retry, say): stop here, and say so on the row
        outcome = Outcome(False, error="not sent: the channel is disabled")
    jitter = random.uniform(0.8, 1.2)  # one for the group, so its retries stay together
    with sessions() as session:
        for delivery in deliveries:
            record(session, delivery.id, outcome, stamp=now(), jitter=jitter)
        session.commit()
    if not outcome.ok:
        log.warning("alert deliveries %s (to channel %r) failed: %s", delivery_ids, channel.name, outcome.error)
    return outcome


def _superseded(session: Session, delivery: models.AlertDelivery, flip: models.AlertFlip | None) -> bool:
    """A retried firing notice (or a reminder) of an alert that has resolved since. A first attempt always goes
    out (its resolve waits for it: `_resolves_held`), so that a brief NaN is never told only as resolved."""
    if flip is None or flip.new_state != "firing" or (delivery.attempt == 1 and flip.old_state != "firing"):
        return False
    alert = session.get(models.Alert, flip.alert_id)
    return alert is not None and alert.state != "firing"


def record(session: Session, delivery_id: int, outcome: Outcome, *, stamp: datetime, jitter: float = 1.0) -> None:
    """Store the outcome on the attempt's row; queue the next attempt after a temporary failure (for `RETRY_FOR`)."""
    delivery = session.get(D, delivery_id)
    assert delivery is not None
    delivery.finished_at, delivery.response_status, delivery.error = stamp, outcome.status, outcome.error
    flip = session.get(models.AlertFlip, delivery.flip_id) if delivery.flip_id is not None else None
    if outcome.ok:
        delivery.status = "delivered"
    elif outcome.temporary and flip is not None and stamp - utc(flip.created_at) < RETRY_FOR:
        delivery.status = "retried"
        _requeue(session, delivery, stamp, outcome.retry_after_s, jitter)
    else:
        delivery.status = "failed"
        if outcome.temporary and flip is not None:
            hours = RETRY_FOR.total_seconds() / 3600
            delivery.error = f"{outcome.error} (gave up after {delivery.attempt} attempts over {hours:g} h)"


def _requeue(
    session: Session, delivery: models.AlertDelivery, stamp: datetime, retry_after_s: float | None, jitter: float
) -> None:
    backoff = min(600.0, 2.0 ** (delivery.attempt - 1)) * jitter
    delay = retry_after_s if retry_after_s is not None else backoff
    session.add(
        D(
            flip_id=delivery.flip_id,
            channel_id=delivery.channel_id,
            attempt=delivery.attempt + 1,
            status="queued",
            due_at=stamp + timedelta(seconds=delay),
            created_at=stamp,
            claimed_at=None,
            finished_at=None,
            response_status=None,
            error=None,
        )
    )
    session.info[WAKE] = True


def recover_stale(session: Session, *, stamp: datetime, timeout_s: float) -> int:
    """Attempts claimed by a process that died before recording an outcome (`timeout_s`: a send's longest) are
    retried."""
    cutoff = stamp - timedelta(seconds=max(60.0, STALE_SENDS * timeout_s))
    stale = session.scalars(select(D.id).where(D.status == "sending", D.claimed_at < cutoff).limit(100)).all()
    for delivery_id in stale:
        done = session.execute(
            update(D)
            .where(D.id == delivery_id, D.status == "sending")
            .values(status="claimed")
            .execution_options(synchronize_session=False)
        )
        if cast(CursorResult[Any], done).rowcount == 1:
            record(
                session,
                delivery_id,
                Outcome(False, temporary=True, error="the sending process stopped without an outcome"),
                stamp=stamp,
            )
    session.commit()
    return len(stale)


def send_test(
    session: Session, channel: models.AlertChannel, *, base_url: str, timeout_s: float, scope: str = "private"
) -> tuple[models.AlertDelivery, Notice]:
    """Send a test notification now and record it as a delivery without retries."""
    notice = test_notice(channel, base_url)
    outcome = send(channel, notice, timeout_s=timeout_s, scope=scope)
    stamp = now()
    delivery = D(
        flip_id=None,
        channel_id=channel.id,
        attempt=1,
        status="delivered" if outcome.ok else "failed",
        due_at=stamp,
        created_at=stamp,
        claimed_at=stamp,
        finished_at=stamp,
        response_status=outcome.status,
        error=outcome.error,
    )
    session.add(delivery)
    session.commit()
    return delivery, notice
