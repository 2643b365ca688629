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
