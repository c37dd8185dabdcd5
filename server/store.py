"""The names of the former data module, kept for code that still imports them: writes live in
`ampwatch.server.ingestion` (the ingest service), reads in `ampwatch.server.queries` (the read model)."""

from __future__ import annotations

from ampwatch.server import alerts  # noqa: F401  (tests patch alerts.on_batch through here)
from ampwatch.server.db import now  # noqa: F401
from ampwatch.server.ingestion import UnknownRun, ingest_batch, register_run  # noqa: F401
from ampwatch.server.queries import (  # noqa: F401
    count_events,
    feed_position,
    get_run,
    get_runs,
    last_event_id,
    layer_heatmap,
    list_alerts,
    list_events,
    list_runs,
    project_names,
    read_series,
    run_ranks,
    series_names,
    series_names_of,
)
