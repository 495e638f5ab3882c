"""Route tables for TRY_RESTORE_PREFILL(_DECODE): every row, and the token-count rule."""

import pytest

from skippy_zmq.stage.routing import Route, check_restore_tokens, decide_restore_route, decide_route

# (local_hit, has_downstream, route), one row per case.
RESTORE_DECODE_TABLE = [
    (False, False, Route.DIRECT_MISS),
    (False, True, Route.DIRECT_MISS),
    (True, True, Route.FORWARD_HIT),
    (True, False, Route.DIRECT_HIT),
]
RESTORE_TABLE = [
    (False, False, Route.DIRECT_MISS),
    (False, True, Route.DIRECT_MISS),
    (True, True, Route.FORWARD_HIT),
    (True, False, Route.DIRECT_HIT),
]


@pytest.mark.parametrize("local_hit,has_downstream,route", RESTORE_DECODE_TABLE)
def test_restore_decode_route_table(local_hit, has_downstream, route):
    assert decide_route(local_hit, has_downstream) is route


@pytest.mark.parametrize("local_hit,has_downstream,route", RESTORE_TABLE)
def test_restore_route_table(local_hit, has_downstream, route):
    assert decide_restore_route(local_hit, has_downstream) is route


def test_tables_cover_every_input():
    for table in (RESTORE_DECODE_TABLE, RESTORE_TABLE):
        assert {(hit, down) for hit, down, _ in table} == {(h, d) for h in (False, True) for d in (False, True)}


@pytest.mark.parametrize("n", [0, 1])
def test_restore_needs_prefix_plus_current(n):
    with pytest.raises(ValueError) as err:
        check_restore_tokens(n)
    assert str(err.value) == (
        "TRY_RESTORE_PREFILL_DECODE needs at least one prefix token plus the current token "
        f"(got {n} tokens)"
    )


@pytest.mark.parametrize("n", [2, 3, 4096])
def test_restore_accepts_prefix_plus_current(n):
    check_restore_tokens(n)
