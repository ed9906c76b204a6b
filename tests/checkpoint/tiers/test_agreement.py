"""Which local step the processes' offers make whole, and where a process's missing parts come from.

The offers are built here as each process would gather them; the processes and their collective are
tests/checkpoint/tiers/test_restart_processes.py's and test_peers_processes.py's.
"""

import json

from flaxstate.checkpoint.tiers.agreement import Offer, Offers

RUN = "run-a"


def gathered(*offers: Offer) -> Offers:
    """The offers as every process decodes them after the all-gather (through JSON)."""
    return Offers([Offer.from_json(json.loads(json.dumps(offer.to_json()))) for offer in offers])


def test_an_offer_survives_the_all_gather_as_it_was_made():
    offer = Offer(
        held=frozenset({(4, RUN), (2, None)}),
        copies={1: frozenset({(4, RUN)}), 3: frozenset({(2, "other")})},
        needs="abc",
        note="step 6: damaged",
        persistent=2,
        run=RUN,
        newest=6,
    )
    assert gathered(offer).offers == (offer,)


def test_a_step_held_by_every_process_is_whole_and_moves_nothing():
    offers = gathered(
        Offer(held=frozenset({(2, RUN), (4, RUN)}), persistent=2, run=RUN, newest=4),
        Offer(held=frozenset({(2, RUN), (4, RUN)}), persistent=None, run=None, newest=4),
    )
    assert offers.whole() == {(2, RUN), (4, RUN)}
    assert offers.transfers((4, RUN)) == ()
    assert (offers.persistent, offers.run, offers.passed_over) == (2, RUN, True)


def test_a_replaced_host_s_parts_come_from_a_peer_copy_before_a_replica():
    offers = gathered(
        Offer(held=frozenset({(4, RUN)}), copies={1: frozenset({(4, RUN)})}, needs="same", newest=4),
        Offer(needs="same", note="it holds no local step (a new or replaced host?)"),
        Offer(held=frozenset({(4, RUN)}), needs="same", newest=4),
    )
    assert offers.sources(1, (4, RUN)) == [(0, True), (0, False), (2, False)]
    assert offers.whole() == {(4, RUN)}
    assert offers.transfers((4, RUN)) == ((0, True, 1),)


def test_a_replica_s_own_step_stands_for_a_lost_process_only_where_their_devices_need_the_same_parts():
    replicas = gathered(Offer(held=frozenset({(4, RUN)}), needs="same"), Offer(needs="same"))
    assert replicas.transfers((4, RUN)) == ((0, False, 1),)
    shards = gathered(Offer(held=frozenset({(4, RUN)}), needs="half 0"), Offer(needs="half 1", note="no local step"))
    assert shards.whole() == set()
    assert shards.lost((4, RUN)) == [1]
    assert shards.why_none_whole() == "no local step is whole on every process (process 1: no local step)"


def test_with_peer_copies_the_reason_names_whose_parts_no_one_keeps():
    offers = gathered(
        Offer(held=frozenset({(4, RUN)}), copies={1: frozenset({(4, RUN)})}, needs="a"),
        Offer(held=frozenset({(2, RUN)}), needs="b"),
        Offer(needs="c"),
    )
    assert offers.whole() == set()
    assert offers.why_none_whole() == (
        "no local step is whole on every process (process 0 holds [4]; process 1 holds [2]); counting peer copies, "
        "step 4 still lacks the parts of process 2: neither its own directory nor a peer keeps them, as a copy or a "
        "replica's own step (more hosts lost than copies kept)"
    )


def test_the_same_step_number_of_another_run_is_another_step():
    offers = gathered(Offer(held=frozenset({(4, RUN)})), Offer(held=frozenset({(4, "run-b")})))
    assert offers.whole() == set()
    assert offers.lost((4, RUN)) == [1] and offers.lost((4, "run-b")) == [0]
    assert not offers.passed_over  # no process said it has a local step (newest) at all
