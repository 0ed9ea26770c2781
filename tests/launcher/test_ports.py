"""Free ports: distinct within a call and across calls of one process."""

from __future__ import annotations

import socket

from launcher.procs import free_port, free_ports
from launcher.stack import TritonPorts


def test_one_call_never_repeats_a_port_and_each_is_bindable():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports[:8]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_later_calls_never_hand_out_an_earlier_port():
    seen = set(free_ports(16))
    for _ in range(32):
        port = free_port()
        assert port not in seen
        seen.add(port)
    triton = TritonPorts.free()
    assert len({triton.http, triton.grpc, triton.metrics} | seen) == len(seen) + 3
