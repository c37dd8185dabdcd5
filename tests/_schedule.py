"""The order the tests run in under pytest-xdist: the slow ones lead each worker's share. Imported as `_schedule`.

`pytest -n 4 --dist worksteal` hands each worker an equal, contiguous part of the collected order, and a worker that
runs out takes the second half of the longest remaining queue. A slow test near the end of a part runs last while the
other workers wait, and a module cut between workers has its framework imported by each. So the tests in SLOW are
taken out, grouped by module, dealt to the parts heaviest group first (each to the lightest part so far) and put at
the head of their part; the other tests keep their order and fill the parts up. Without xdist the order is pytest's.
"""

from __future__ import annotations

import pytest

# Node-id prefixes of the slow tests, and about how long each test they name takes alone on a quiet 2-core machine
# (seconds). A new test that takes more than ~5 s belongs here; the numbers only order the tests, they check nothing.
SLOW: dict[str, float] = {
    "tests/test_transformers.py": 7,  # (the first of a worker's also imports transformers: ~3 s of CPU)
    "tests/test_distributed.py": 11,  # torchrun and Lightning launch two ranks
    "tests/test_bench.py": 4,
    "tests/test_signals.py": 4,
    "tests/test_robust_kill.py": 12,
    "tests/test_robust_sqlite.py": 10,
    "tests/test_replicas.py": 20,
    "tests/test_fuzz.py": 8,
    "tests/test_deepspeed.py": 3,
    "tests/test_integrations.py": 2,  # (Lightning's import: ~3 s of CPU in each worker that runs one)
    "tests/alerts/test_alerts_replicas.py": 6,
    "tests/alerts/test_alerts_liveness.py": 4,
    "tests/test_agent_exit.py": 2,
    "tests/test_ingest_api.py::test_a_batch_with_more_series_than_postgres_takes_parameters_is_stored": 12,
    "tests/test_runs_list.py::test_a_page_of_runs_costs_the_same_statements_at_10_and_200_runs": 10,
    "tests/test_roles.py::test_the_guard_enforces_the_declared_roles": 12,
    "tests/test_spool.py::test_a_server_down_for_the_middle_third_of_a_run_loses_nothing": 9,
    "tests/test_schema.py::test_a_database_out_of_reach_or_a_broken_rules_file_is_one_line_and_exit_2": 7,
    "tests/test_security.py::test_revoked_token_stops_working_and_only_hashes_are_stored": 7,
    "tests/test_diagnosis_review.py::test_a_converged_small_batch_classifier_has_no_loss_spikes": 9,
    "tests/test_diagnosis_realcode.py::test_healthy_runs_get_no_warning_and_no_alert": 8,
    "tests/test_leading_indicators.py::test_no_indicator_warns_over_thousands_of_healthy_fp16_steps": 5,
    "tests/test_demo.py::test_demo_trains_an_unstable_run_and_prints_the_dashboard": 6,
    "tests/test_stop.py::test_every_ddp_rank_raises_stop_requested_after_the_same_step_the_server_fixed": 8,
    "tests/test_stop.py::test_every_ddp_rank_stops_on_a_critical_event_after_the_same_step": 12,
}


def seconds(nodeid: str) -> float:
    """The time SLOW gives the test (by its longest matching prefix); 0 for a test not listed."""
    matches = [prefix for prefix in SLOW if nodeid == prefix or nodeid.startswith((f"{prefix}::", f"{prefix}["))]
    return SLOW[max(matches, key=len)] if matches else 0.0


def order(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """`items` in the order that puts the slow tests at the head of the `workers` parts xdist's worksteal cuts it
    into."""
    weight = {item.nodeid: seconds(item.nodeid) for item in items}
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if weight[item.nodeid]:
            groups.setdefault(item.nodeid.split("::")[0], []).append(item)
    if workers < 2 or not groups:
        return list(items)
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for group in sorted(groups.values(), key=lambda g: -sum(weight[i.nodeid] for i in g)):
        lightest = loads.index(min(loads))
        heads[lightest] += group
        loads[lightest] += sum(weight[i.nodeid] for i in group)
    rest = [item for item in items if not weight[item.nodeid]]
    ordered: list[pytest.Item] = []
    for part, head in enumerate(heads):
        size = max(len(head), (len(items) - len(ordered)) // (workers - part))  # worksteal's cut: equal counts
        fill = size - len(head)
        ordered += head + rest[:fill]
        rest = rest[fill:]
    return ordered + rest
