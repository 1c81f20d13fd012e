"""Whether the driver reaches each Ray node at its announced address, and what it says
when not: real sockets on 127.0.0.1 (one listening, one closed port), no Ray."""

from __future__ import annotations

import os
import socket
import time

from looprl.scheduling.ranks import GLOO_INTERFACE_VARIABLE, use_interface_of
from looprl.scheduling.reachability import (
    RayNode,
    unreachable_message,
    unreachable_nodes,
)


def test_a_listening_node_answers_and_a_closed_port_is_named_with_the_fix():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]  # bound, never listening: refused
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            up = RayNode("127.0.0.1", "127.0.0.1", listening.getsockname()[1], head=True)
            down = RayNode("gpu-7", "127.0.0.1", closed_port)
            started = time.monotonic()
            bad = unreachable_nodes([up, down], timeout_s=2)
    assert time.monotonic() - started < 2
    assert [node for node, _ in bad] == [down]
    message = unreachable_message(down, bad[0][1], "10.0.0.1:6379")
    assert message.startswith(
        f"Ray node gpu-7 (127.0.0.1) announced the address 127.0.0.1, and this machine "
        f"cannot reach it (127.0.0.1:{closed_port}, its raylet: Connection refused)"
    )
    assert "`ray start --address=10.0.0.1:6379 --node-ip-address=<an address" in message
    assert "LOOPRL_NET_IFACE=" in message


def test_an_address_that_never_answers_times_out_within_the_timeout():
    # TEST-NET-1 (RFC 5737): routed nowhere; without a route at all the error is immediate.
    node = RayNode("192.0.2.1", "192.0.2.1", 6379)
    started = time.monotonic()
    bad = unreachable_nodes([node, node], timeout_s=1)
    assert time.monotonic() - started < 1.8  # tried at once, not one after the other
    assert [n for n, _ in bad] == [node, node] and all(error for _, error in bad), bad


def test_gloo_is_pinned_to_the_interface_of_the_nodes_ip_unless_set(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE_VARIABLE, raising=False)
    assert use_interface_of("127.0.0.1") == "lo"
    assert os.environ[GLOO_INTERFACE_VARIABLE] == "lo"
    monkeypatch.setenv(GLOO_INTERFACE_VARIABLE, "eth7")
    assert use_interface_of("127.0.0.1") == "eth7"  # the user's choice stands
    monkeypatch.delenv(GLOO_INTERFACE_VARIABLE)
    assert use_interface_of("192.0.2.1") is None  # not this machine's: gloo's own choice
    assert GLOO_INTERFACE_VARIABLE not in os.environ
