"""One rule for every engine and router address: anything but loopback requires an API key.

`config.require_api_key` owns it; config validation, the engine command line and the Slurm
engine role all ask it. The loopback cases are the addresses RFC 1122 (127.0.0.0/8) and
RFC 4291 (::1) reserve, plus the names Debian-style images put in /etc/hosts.
"""

from __future__ import annotations

import pytest

from dapo_mega.config import ConfigError, RolloutConfig, is_loopback, require_api_key
from dapo_mega.engines.sglang.commands import build_engine_command


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("127.0.1.1", True),  # Debian maps the machine's own hostname to 127.0.1.1
    ("127.255.255.254", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("192.168.1.1", False),
    ("128.0.0.1", False), ("node01", False), ("localhost.example.com", False), ("", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_non_loopback_without_a_key_names_the_field_and_the_fix():
    require_api_key("127.0.0.1", "", "rollout.api_key")  # loopback: no key needed
    require_api_key("0.0.0.0", "k", "rollout.api_key")  # a key: any address
    with pytest.raises(ConfigError, match=r"^rollout.api_key: engines bind to 0.0.0.0 without an API key.*"
                                          r"Fix: set rollout.api_key \(or bind 127.0.0.1\)$"):
        require_api_key("0.0.0.0", "", "rollout.api_key")
    with pytest.raises(ConfigError, match=r"^--api-key: .* Fix: pass --api-key$"):
        require_api_key("node01", "", "--api-key", "pass --api-key")


def test_config_and_engine_command_share_the_rule():
    with pytest.raises(ConfigError, match="rollout.api_key: engines bind to 10.0.0.5"):
        RolloutConfig(host="10.0.0.5").validate()
    RolloutConfig(host="127.0.1.1").validate()
    # a bind host given to the command (multi-node: the node's address) is held to it too
    with pytest.raises(ConfigError, match="rollout.api_key: engines bind to 10.0.0.5"):
        build_engine_command(RolloutConfig(), "/m", port=1, host="10.0.0.5")
    argv = build_engine_command(RolloutConfig(api_key="k"), "/m", port=1, host="10.0.0.5")
    assert argv[argv.index("--api-key") + 1] == "k"
