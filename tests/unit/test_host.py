"""host.py: HOST:PORT parsing, and the heap trimmer long-running processes start."""

from __future__ import annotations

import threading

import pytest

from shardline.errors import ShardlineError
from shardline.host import parse_hostport, trim_memory_every


def test_host_port_parses_names_ipv4_and_bracketed_ipv6() -> None:
    assert parse_hostport("127.0.0.1:7001") == ("127.0.0.1", 7001)
    assert parse_hostport(" node-2:0 ") == ("node-2", 0)
    assert parse_hostport("[::1]:65535") == ("::1", 65535)


@pytest.mark.parametrize("bad", ["127.0.0.1", ":7001", "host:", "host:-1", "host:65536", "host:7o01", ""])
def test_a_bad_address_is_refused_with_the_flag_named(bad: str) -> None:
    with pytest.raises(ShardlineError, match="--listen must be HOST:PORT with a port in 0-65535"):
        parse_hostport(bad, "--listen")


def test_the_heap_trimmer_runs_once_per_process() -> None:
    trim_memory_every(0.05)
    trim_memory_every(0.05)
    trimmers = [t for t in threading.enumerate() if t.name == "trim-memory"]
    assert len(trimmers) == 1 and trimmers[0].daemon and trimmers[0].is_alive()


def test_machines_count_this_one_and_each_other_host_once() -> None:
    """Issue 56: a paged engine keeps one step in flight per machine its stages run on."""
    from shardline.host import machines

    local = {"10.0.0.5", "fe80::1", "box"}
    assert machines([], local) == 1
    assert machines(["127.0.0.1:7001", "localhost:7002", "[::1]:7003", "127.0.0.2:7004"], local) == 1
    assert machines(["10.0.0.5:7001", "BOX:7002"], local) == 1  # this machine's own address and name
    assert machines(["10.0.0.6:7001", "10.0.0.7:7001", "10.0.0.6:7002"], local) == 3
    assert machines(["pc-a:7001", "127.0.0.1:7002"], local) == 2
    with pytest.raises(ShardlineError, match="a worker's address must be HOST:PORT"):
        machines(["nowhere"], local)


def test_this_machines_addresses_include_loopback_and_its_name() -> None:
    import socket

    from shardline.host import local_addresses

    mine = local_addresses()
    assert "127.0.0.1" in mine and socket.gethostname().lower() in mine
