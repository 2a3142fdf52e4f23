"""What `--node-addr` derives for the launcher and Gloo, and what the harness says without root
(no namespaces needed)."""

from __future__ import annotations

import pytest

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError, LaunchConfig
from shardwise.elastic import NODE_ADDR
from shardwise.launch import interface_of, node_addr_settings, torchrun_args


def test_node_0_hosts_the_rendezvous_and_every_node_publishes_its_address():
    for rank, hosts in ((0, "true"), (1, "false")):
        launch = LaunchConfig(nnodes=2, node_rank=rank, rdzv_endpoint="10.0.0.1:29400", node_addr=f"10.0.0.{rank + 1}")
        args = torchrun_args(launch)
        assert f"--local-addr=10.0.0.{rank + 1}" in args
        assert f"--rdzv-conf=is_host={hosts}" in args
        assert "--rdzv-endpoint=10.0.0.1:29400" in args and f"--node-rank={rank}" in args


def test_gloo_binds_to_the_interface_that_holds_the_address_and_the_workers_are_told_it():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") == "lo"
    assert node_addr_settings(LaunchConfig(nnodes=2, node_addr="127.0.0.1")) == {"GLOO_SOCKET_IFNAME": "lo",
                                                                                 NODE_ADDR: "127.0.0.1"}
    assert node_addr_settings(LaunchConfig(nnodes=2)) == {}


@pytest.mark.parametrize(("address", "words"), [("198.51.100.254", "no interface of this machine holds it"),
                                                ("node-0", "not an IP address")])
def test_an_address_this_machine_does_not_hold_is_refused_naming_it(address, words):
    with pytest.raises(ConfigError, match=f"launch.node_addr = '{address}': {words}"):
        interface_of(address)


def test_node_addr_on_one_node_is_refused():
    with pytest.raises(ConfigError, match="launch.node_addr = '10.0.0.1': only for several nodes"):
        load_config(None, ["launch.node_addr='10.0.0.1'"])


def test_without_root_the_harness_and_the_bench_say_they_need_it(monkeypatch, capsys):
    from bench import multinode, netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable_reason() == "network namespaces need root (run as root, as CI does)"
    with pytest.raises(netns.NetnsUnavailable, match="need root"):
        netns.Cluster(2).up()
    assert multinode.main(["--json", "unused.json"]) == 2
    assert "bench multinode: it makes its nodes as network namespaces, and network namespaces need root" in \
        capsys.readouterr().err
