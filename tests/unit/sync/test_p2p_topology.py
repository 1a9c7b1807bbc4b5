"""p2p chooses its channel per engine by node: shared memory on the sender's Ray node, the network
across nodes, even when both nodes are loopback addresses of one machine (tests/e2e/test_cluster.py
runs it so)."""

import socket

from miles.sync.transports.p2p import is_local


def test_an_engine_on_the_senders_node_is_local_and_one_on_another_node_is_not():
    assert is_local("http://127.0.0.3:4000", node_address="127.0.0.3")
    assert not is_local("http://127.0.0.4:4000", node_address="127.0.0.3")
    assert is_local("http://10.1.2.3:4000", node_address="10.1.2.3")
    assert not is_local("http://10.9.9.9:4000", node_address="10.1.2.3")


def test_plain_loopback_and_this_machines_name_are_the_senders_machine():
    # No Ray node is ever 127.0.0.1 or localhost: a server there is on the sender's own machine.
    assert is_local("http://127.0.0.1:4000", node_address="127.0.0.3")
    assert is_local("http://localhost:4000", node_address="127.0.0.3")
    assert is_local(f"http://{socket.gethostname()}:4000", node_address="127.0.0.3")
