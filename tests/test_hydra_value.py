"""`config.hydra_value` writes a string as a Hydra override value that Hydra reads back unchanged.

The reference is Hydra's own override parser (`OverridesParser.parse_override`, the
OverrideLexer.g4 grammar) and, for the whole way into a config, `load_config` (Hydra
compose + OmegaConf, which interpolates `${...}` once the override is applied).
"""

from __future__ import annotations

import random

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from dapo_mega.config import hydra_value, load_config

PARSER = OverridesParser.create()

NEEDS_CARE = [
    "", " ", "a b", "/lustre/my runs/run-1", "a,b", "[1,2]", "{a:1}", "f(x)", "it's", 'say "hi"',
    "k=v", "$HOME", "100%", "a\\b", "C:\\runs\\", "ends\\'", "\\'", "\t", "~user", "#1", "x!",
    "true", "False", "null", "NULL", "inf", "-nan", "10", "1_000", "007", "1.5", ".5", "1.", "1e3", "-2E-5",
    "1.5.6", "1-2", "-", "+x", ".", "/a/b:c", "user@host", "s3://bucket/key", "a?b|c*d", "sk-Zq9_x.Y",
]


def parsed(value_text: str):
    return PARSER.parse_override(f"rollout.api_key={value_text}").value()


@pytest.mark.parametrize("value", NEEDS_CARE)
def test_values_read_back_by_hydras_parser(value):
    assert parsed(hydra_value(value)) == value


def test_plain_paths_stay_bare_and_the_rest_is_quoted():
    assert hydra_value("/lustre/run-1") == "/lustre/run-1"
    assert hydra_value("s3://b/k@v1") == "s3://b/k@v1"
    for value in ("a b", "true", "1e3", "10", "", "it's"):
        assert hydra_value(value).startswith("'"), value


def test_random_strings_read_back():
    rng = random.Random(0)
    alphabet = "ab/ .,=[]{}()'\"\\:@%*?|~#!\t-+0e1_$"
    for _ in range(400):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))).replace("${", "$ {")
        assert parsed(hydra_value(value)) == value, repr(value)


@pytest.mark.parametrize("value", ["${oc.env:HOME}", "a\\${b}", "it's ${x} \\", "k3y,with=all [of] it"])
def test_values_reach_the_config_unchanged(value):
    """`${` would be interpolated by OmegaConf after Hydra parsed the override: escaped too."""
    assert load_config([f"rollout.api_key={hydra_value(value)}"]).rollout.api_key == value
