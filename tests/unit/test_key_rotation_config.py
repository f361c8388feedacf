"""Key rotation's pure pieces (decode_node.service --rotate-key-after): the config check, the CLI
flag, the launcher's decode-only flags, and reading fabric addresses and this process's sockets
(decode_node.fabric_sockets); the fabric and cluster behaviour is tested in
tests/fabric/test_key_rotation_sockets.py and tests/integration/test_key_rotation.py."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from decode_node.__main__ import build_parser
from decode_node.service import DecodeNodeConfig
from fabric.sockets import Endpoint, endpoint_of, fabric_sockets, open_inodes, own_tcp_sockets, shut_down
from kv_messenger.decode.rotation import SUGGESTED_ROTATE_KEY_AFTER_S
from pdserve.engine.config import EngineConfig
from pdserve.tools.launcher import ClusterConfig, plan


def test_config_off_by_default_and_a_bad_value_is_named():
    assert DecodeNodeConfig(engine=EngineConfig(), node_id="d").rotate_key_after_s is None
    cfg = DecodeNodeConfig(engine=EngineConfig(), node_id="d", rotate_key_after_s=SUGGESTED_ROTATE_KEY_AFTER_S)
    assert cfg.rotate_key_after_s == SUGGESTED_ROTATE_KEY_AFTER_S
    for bad in (0, -1.5):
        with pytest.raises(ValueError, match=f"rotate_key_after_s must be > 0.*{bad}"):
            DecodeNodeConfig(engine=EngineConfig(), node_id="d", rotate_key_after_s=bad)


def test_cli_flag_and_help():
    p = build_parser()
    assert p.parse_args(["--prefill", "h:1"]).rotate_key_after is None
    assert p.parse_args(["--prefill", "h:1", "--rotate-key-after", "2.5"]).rotate_key_after == 2.5
    assert p.parse_args(["--prefill", "h:1", "--rotate-key-after", "off"]).rotate_key_after is None
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            p.parse_args(["--prefill", "h:1", "--rotate-key-after", bad])
    assert "--rotate-key-after" in p.format_help()


def test_launcher_gives_decode_args_to_decode_nodes_only():
    specs = plan(ClusterConfig(prefill=1, decode=2, port=0, decode_args=("--rotate-key-after", "3")))
    for spec in specs:
        assert ("--rotate-key-after" in spec.argv) == (spec.role == "decode"), (spec.role, spec.argv)


def test_endpoint_of_sockaddrs():
    v4 = struct.pack("=H", socket.AF_INET) + struct.pack("!H", 43389) + bytes([127, 0, 0, 1]) + bytes(8)
    assert endpoint_of(v4) == Endpoint(ipaddress.IPv4Address("127.0.0.1"), 43389)
    v6 = struct.pack("=H", socket.AF_INET6) + struct.pack("!H", 7) + bytes(4) + ipaddress.IPv6Address("::1").packed
    assert endpoint_of(v6 + bytes(4)) == Endpoint(ipaddress.IPv6Address("::1"), 7)
    assert endpoint_of(b"shm-name-bytes") is None


def test_own_sockets_are_read_and_a_shut_socket_is_reset_for_the_reader():
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    try:
        port = srv.getsockname()[1]
        here = Endpoint(ipaddress.IPv4Address("127.0.0.1"), port)
        mine = {s.inode: s for s in own_tcp_sockets()}
        assert any(s.local == here and s.state == 0x0A for s in mine.values()), "the listener is not listed"
        found = fabric_sockets({here}, set())
        assert [s.fd for s in found] == [acc.fileno()]   # the accepted one; never the listener
        assert shut_down(found) == {found[0].inode}
        assert acc.recv(10) == b""                        # its reader sees end-of-stream
        cli.sendall(b"late bytes")                        # data after the shutdown: reset, never read
        try:
            late = acc.recv(10)
        except ConnectionResetError:
            late = b""
        assert late == b""
        with pytest.raises((ConnectionResetError, BrokenPipeError)):   # the writer's side was reset
            for _ in range(50):
                cli.sendall(b"x")
                cli.recv(1)
        assert open_inodes({found[0].inode}) == {found[0].inode}   # closing is the owner's (the provider's)
        acc.close()
        assert open_inodes({found[0].inode}) == set()
    finally:
        for s in (cli, acc, srv):
            s.close()
