"""With the token set, every RPC of every service refuses calls without it, except the
documented open ones; undecodable requests get INVALID_ARGUMENT and one log line. Against real
reward, sampler and trainer processes; the RPCs are read from the service descriptors."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from rpc_catalog import call_raw, health_rpcs, splitrl_rpcs
from services import AUTH

from splitrl.auth import rpc_methods
from splitrl.config import AuthConfig
from splitrl.serving import make_channel

REPO = Path(__file__).resolve().parents[2]
OPEN = set(AuthConfig().open_methods)
GARBAGE = b"\x0a\x05ab"  # field 1, length 5, but only 2 bytes follow: never decodes


def _empty(rpc):
    return [] if rpc.method.client_streaming else b""


def test_the_open_methods_are_few_and_each_rpc_is_documented():
    assert OPEN == {"grpc.health.v1.Health/Check", "splitrl.v1.Trainer/Status"}
    names = {str(r) for r in splitrl_rpcs() + health_rpcs()}
    assert names == set(rpc_methods())
    doc = (REPO / "docs" / "security.md").read_text()
    missing = [name for name in sorted(names) if f"`{name}`" not in doc]
    assert not missing, f"docs/security.md does not say how these are protected: {missing}"


@pytest.mark.parametrize("rpc", splitrl_rpcs() + health_rpcs(),
                         ids=lambda r: f"{r.server}:{r.name}")
def test_without_the_token_only_the_open_methods_answer(services, rpc):
    address = services[rpc.server].address
    # A Watch stream never ends by itself: a short deadline ends the authorised one.
    timeout_s = 2.0 if rpc.name.endswith("Health/Watch") else 30.0
    with make_channel(address) as channel:
        missing, details = call_raw(channel, rpc, _empty(rpc), timeout_s=timeout_s)
        wrong, _ = call_raw(channel, rpc, _empty(rpc), timeout_s=timeout_s,
                            metadata=(("authorization", "Bearer not-the-token"),))
    with make_channel(address, auth=AUTH) as channel:
        authorised, authorised_details = call_raw(channel, rpc, _empty(rpc),
                                                  timeout_s=timeout_s)
    assert authorised != grpc.StatusCode.UNAUTHENTICATED, authorised_details
    if rpc.name in OPEN:
        assert missing == wrong == grpc.StatusCode.OK, details
    else:
        assert missing == wrong == grpc.StatusCode.UNAUTHENTICATED, (missing, wrong, details)
        assert f"{rpc.name} needs the auth token" in details


@pytest.mark.parametrize("rpc", splitrl_rpcs(), ids=lambda r: f"{r.server}:{r.name}")
def test_an_undecodable_request_is_invalid_argument_in_one_log_line(services, rpc):
    service = services[rpc.server]
    start = service.log_size()
    with make_channel(service.address, auth=AUTH) as channel:
        payload = [GARBAGE] if rpc.method.client_streaming else GARBAGE
        code, details = call_raw(channel, rpc, payload, timeout_s=30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert f"is not a valid {rpc.method.input_type.full_name} (4 bytes" in details
    lines = service.log_lines(start)
    assert not [r for r in lines if "exc" in r or "raw" in r], lines  # no traceback
    warnings = [r for r in lines if r.get("level") in ("warning", "error", "critical")]
    assert len(warnings) == 1, warnings
