"""CampaignOptions and the room plan: the settle bound comes from the lease (and, on two hosts,
the cut), the new faults are planned from the seed, and a bad configuration is refused."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvfsm.chaos._cli import add_parser, options
from kvfsm.chaos._options import OVERSIZED_PAGES, CampaignOptions, episode_plan
from kvfsm.rooms import RoomConfig
from kvfsm.states import Role


def test_one_host_settle_bound_is_the_lease_plus_the_unfenced_window() -> None:
    opts = CampaignOptions()
    opts.validate()
    channel = opts.channel()
    assert channel.lease_s == opts.lease_s == 2.0
    assert channel.settle_after_loss_s == opts.settle_after_loss_s() == 3.0
    # How long prefill can be stopped no longer matters: that is what fencing removed.
    stopped_longer = dataclasses.replace(opts, sigstop_max_s=60.0)
    assert stopped_longer.settle_after_loss_s() == opts.settle_after_loss_s()


def test_two_hosts_margin_keeps_the_cut_term() -> None:
    opts = CampaignOptions(two_hosts=True)
    opts.validate()
    # A WRITE posted under the lease may sit in TCP across the cut, and land after it.
    assert opts.needed_margin_s() > 2 * opts.link_cut_max_s
    assert opts.margin_s() >= opts.needed_margin_s()
    assert opts.channel().fence_margin_s == opts.margin_s()
    longer = dataclasses.replace(opts, link_cut_max_s=5.0)
    assert longer.settle_after_loss_s() == opts.settle_after_loss_s() + 4.0


def test_a_margin_short_of_the_unfenced_window_is_refused() -> None:
    with pytest.raises(ValueError, match="fence_margin_s"):
        CampaignOptions(fence_margin_s=0.5).validate()
    with pytest.raises(ValueError, match="fence_margin_s"):
        CampaignOptions(two_hosts=True, fence_margin_s=3.0).validate()
    CampaignOptions(fence_margin_s=1.0).validate()


def test_long_freezes_outlast_the_settle_bound_and_the_settle_timeout_outlasts_them() -> None:
    opts = CampaignOptions()
    low, high = opts.long_freeze_s()
    assert opts.settle_after_loss_s() < low <= high
    # A prefill room that ended just before the longest freeze must still be able to settle
    # after it (its own timer ran on through the freeze).
    assert opts.room_settle_timeout_s() > high + opts.settle_after_loss_s()
    with pytest.raises(ValueError, match="outlast"):
        CampaignOptions(long_freeze_factor=(0.5, 2.0)).validate()


def test_decode_may_name_more_pages_than_a_frame_holds() -> None:
    opts = CampaignOptions()
    decode = opts.manager_config(None, role="decode").rooms.max_pages
    prefill = opts.manager_config(None, role="prefill").rooms.max_pages
    assert prefill == RoomConfig().max_pages
    # One oversized kind is over decode's max_pages, the other under it but over 16 MiB of
    # packed int32 page indices.
    assert OVERSIZED_PAGES["max_pages"] > decode > OVERSIZED_PAGES["frame"]
    assert OVERSIZED_PAGES["frame"] * 4 > 16 * 2**20


def test_the_plan_draws_the_new_faults_from_the_seed_without_reshuffling_the_rest() -> None:
    base = CampaignOptions(seed=9, rooms=400, reuse_rate=0.0, oversized_rate=0.0)
    faulty = dataclasses.replace(base, reuse_rate=0.1, oversized_rate=0.1)
    plain, planned = episode_plan(base, 0, 0), episode_plan(faulty, 0, 0)
    assert planned == episode_plan(faulty, 0, 0)  # both ranks compute the same list
    assert not any(p.reuse or p.oversized for p in plain)
    reused = [p for p in planned if p.reuse]
    oversized = [p for p in planned if p.oversized]
    assert 20 <= len(reused) <= 65
    assert 20 <= len(oversized) <= 65
    assert {p.oversized for p in oversized} == {"max_pages", "frame"}
    # A reused id is aborted by decode after its page list went out.
    assert all(p.abort_side == "decode" and 0 <= p.abort_at <= 3 for p in reused)
    assert all(p.abort_side == "" for p in oversized)
    # Pages, aux rows and chunk cuts are the same whatever the new rates.
    for a, b in zip(plain, planned, strict=True):
        assert (a.room, a.src, a.src_aux, a.cuts) == (b.room, b.src, b.src_aux, b.cuts)


def test_bounds_are_the_deadline_sums() -> None:
    opts = CampaignOptions()
    assert opts.bound_s(Role.SENDER) == 11.0
    assert opts.bound_s(Role.RECEIVER) == 13.0


def test_decode_freezes_outlast_the_silence_limit_and_the_settle_bound() -> None:
    opts = CampaignOptions()
    opts.validate()
    low, high = opts.decode_freeze_range_s()
    assert (low, high) == (4.5, 12.0)  # 1.5 to 4 times the 3 s bound on one host
    assert opts.channel_silence_s() < opts.settle_after_loss_s() < low <= high
    two = CampaignOptions(two_hosts=True)
    two.validate()
    assert two.decode_freeze_range_s() == (16.5, 44.0)  # the bound is 11 s there
    fixed = CampaignOptions(decode_freeze_s=(60.0, 60.0))
    fixed.validate()
    assert fixed.decode_freeze_range_s() == (60.0, 60.0)
    for bad in ((2.0, 10.0), (3.0, 10.0), (10.0, 5.0)):
        with pytest.raises(ValueError, match="outlast"):
            CampaignOptions(decode_freeze_s=bad).validate()
    with pytest.raises(ValueError, match="decode-freeze-rate"):
        CampaignOptions(decode_freeze_rate=1.5).validate()
    with pytest.raises(ValueError, match="decode_freeze_exposed"):
        CampaignOptions(decode_freeze_exposed=0).validate()
    with pytest.raises(ValueError, match="after_resume_s"):
        CampaignOptions(after_resume_s=0.0).validate()


def test_every_wait_covers_the_longest_decode_freeze() -> None:
    """A decode frozen for a minute: its rooms' settle timeout, the ranks' settle wait and the
    drains outlast it, and prefill keeps the tombstones of the rooms it failed meanwhile for
    longer, so that decode's rooms of those ids are answered at once when it wakes."""
    opts = CampaignOptions(decode_freeze_rate=1.0, decode_freeze_s=(60.0, 60.0))
    opts.validate()
    assert opts.longest_stop_s() == 60.0
    assert opts.room_settle_timeout_s() > 60.0 + opts.settle_after_loss_s()
    assert opts.settle_wait_s() > opts.room_settle_timeout_s()
    assert opts.manager_config(None).rooms.settle_timeout_s == opts.room_settle_timeout_s()
    assert opts.channel().pending_ttl_s == opts.pending_ttl_s() == 70.0
    off = dataclasses.replace(opts, decode_freeze_rate=0.0)
    assert off.longest_stop_s() == off.long_freeze_s()[1]  # the prefill freeze's 12 s again
    assert off.pending_ttl_s() == 10.0
    assert CampaignOptions().pending_ttl_s() == 22.0  # 10 s past the default's longest, 12 s


def test_the_transport_option_sets_ucx_tls_in_the_ranks() -> None:
    default = CampaignOptions()
    assert default.transport == "default"
    assert default.rank_env() == {}
    assert default.ucx_transport() == "default"
    tcp = CampaignOptions(transport="tcp")
    tcp.validate()
    assert tcp.rank_env() == {"UCX_TLS": "tcp"}
    assert tcp.ucx_transport() == "tcp"
    # Two hosts run TCP on the veth whatever the option says (each namespace's own env).
    assert CampaignOptions(two_hosts=True).ucx_transport() == "tcp"
    with pytest.raises(ValueError, match="--transport"):
        CampaignOptions(transport="rdma").validate()


def test_the_command_line_reaches_the_new_options() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "chaos",
            "--seed",
            "5",
            "--transport",
            "tcp",
            "--decode-freeze-rate",
            "1",
            "--decode-freeze-s",
            "10",
            "12.5",
        ]
    )
    opts = options(args)
    assert (opts.transport, opts.decode_freeze_rate) == ("tcp", 1.0)
    assert opts.decode_freeze_s == (10.0, 12.5)
    plain = options(parser.parse_args(["chaos", "--seed", "5"]))
    assert plain.decode_freeze_s is None
    assert plain.decode_freeze_rate == CampaignOptions().decode_freeze_rate == 0.2
    assert plain.transport == "default"
    with pytest.raises(SystemExit):
        parser.parse_args(["chaos", "--transport", "shm"])
