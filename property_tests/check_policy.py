"""Run the property tests of the registered policies on a policy registered later: yours.

The hypothesis properties of `test_policy_properties.py`, `test_sharding_properties.py` and
`test_cache_properties.py` run over every name in `vasepatch.policies.available()`, read when pytest
collects them. A policy registered afterwards (in a script, a notebook, a docs page) is not among
them: `check_policy(name)` runs the same test functions, with the same strategies, on that one policy.

    from property_tests.check_policy import check_policy

    check_policy("my-policy")  # the names of the properties it passed; else the first failure, shrunk

A policy with a `stats` option (one that reads a file of calibrated query statistics, as `triattention` does)
gets, in every property, a random but valid statistics file of the drawn case's shapes
(`tests.query_stats_files`, written by `vasepatch.policies.query_stats.save_stats`).

From a clone of the repository, at its root (the property tests are not part of the wheel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings

from property_tests import test_cache_properties as cache
from property_tests import test_policy_properties as policy
from property_tests import test_sharding_properties as sharding
from vasepatch import policies

# test functions taking the policy's `name`: every policy passes these ...
EVERY_POLICY = (
    policy.test_every_policy_returns_distinct_valid_first_indices,
    policy.test_every_policy_is_seeded_reproducible,
    policy.test_the_output_check_accepts_every_policy_and_rejects_each_corruption,
    sharding.test_one_process_and_two_ranks_keep_the_same_slots,
    sharding.test_a_rows_choice_does_not_depend_on_the_rows_after_it,
)
# ... and a policy with a `sinks` option these
SINK_KEEPERS = (policy.test_every_policy_with_a_sinks_option_keeps_the_sinks, cache.test_sinks_are_never_evicted)
# cache properties whose case draws its policy among the registered ones: here it is always `name`
CACHE = (
    cache.test_last_window_tokens_are_kept_in_place,
    cache.test_eviction_keeps_exactly_min_budget_valid_without_duplicates,
    cache.test_attendable_slots_are_one_contiguous_range_ending_at_the_fill_pointer,
    cache.test_kept_slots_are_bit_identical_to_what_was_appended,
    cache.test_occupancy_within_capacity_and_buffers_never_reallocated,
)


def check_policy(name: str, max_examples: int = 200) -> list[str]:
    """Run every property above on the registered policy `name`, `max_examples` examples each (CI's
    profile runs 200); returns the names of the properties run. A failing property raises its error
    (an `AssertionError` or the policy's own) for the smallest failing example hypothesis found, which
    its notes name."""
    options = policies.get(name).options  # an unknown name: ValueError now
    run = settings(
        max_examples=max_examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    done = []
    for prop in (*EVERY_POLICY, *(SINK_KEEPERS if "sinks" in options else ()), *CACHE):
        _again(prop, name, run)()
        done.append(prop.__name__)
    return done


def _again(prop: Callable, name: str, run: settings) -> Callable[[], None]:
    """`prop` as a test of policy `name` alone: its undecorated body under its own strategies (a
    cache case's drawn policy replaced by `name`), with the settings `run`."""
    strategies = dict(prop.hypothesis._given_kwargs)  # what `@given` was called with
    if prop in CACHE:
        strategies["case"] = strategies["case"].map(lambda case: dataclasses.replace(case, policy=name))
        return run(given(**strategies)(prop.hypothesis.inner_test))
    body = prop.hypothesis.inner_test

    def of_name(**drawn):
        body(name, **drawn)

    of_name.__name__ = of_name.__qualname__ = body.__name__  # hypothesis's report names the property
    return run(given(**strategies)(of_name))
