"""A whole run under mutual TLS and the token: every channel (launcher, trainer to samplers,
samplers to the reward service, samplers registering with the trainer) presents the run's
certificate, and nothing without one gets in."""

from __future__ import annotations

import signal

import grpc
import pytest
from tls_certs import SERVER_NAME, make_pki

from splitrl.config import AuthConfig
from splitrl.serving import check_health, make_channel
from splitrl.v1 import trainer_pb2, trainer_pb2_grpc
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    log_records,
    run_config,
    status_step,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)

pytestmark = pytest.mark.slow

# Far more steps than the test lets it train: the trainer must be serving while it is probed
# (a 2-step run could end first; it did, once the steps got faster), and the test stops it.
STEPS = 100_000


def test_a_run_under_mutual_tls_trains_and_refuses_peers_without_a_certificate(
        arith_model, tmp_path):
    pki = make_pki(tmp_path / "pki")
    run_dir = tmp_path / "run"
    cfg = run_config(arith_model, run_dir, f"trainer.steps={STEPS}", "trainer.eval_before=false",
                     "trainer.eval_after=false", "trainer.checkpoint.every=100",
                     "services.num_samplers=1",
                     *pki.overrides(token="s3cret"))
    launcher = Launcher(cfg)
    try:
        launcher.up()  # waits on each service's health over mutual TLS
        launcher.wait_healthy("trainer", launcher.trainer_address)
        addresses = {"reward": launcher.reward_address, "trainer": launcher.trainer_address,
                     **{f"sampler-{i}": a for i, a in enumerate(launcher.sampler_addresses)}}
        no_cert = AuthConfig(tls_ca=str(pki.ca), tls_server_name=SERVER_NAME)
        stranger = pki.auth(token="s3cret", cert=pki.other_cert, key=pki.other_key)
        for name, address in addresses.items():
            assert check_health(address, auth=cfg.services.auth), name
            assert not check_health(address, timeout_s=2, auth=no_cert), name
            assert not check_health(address, timeout_s=2, auth=stranger), name
            assert not check_health(address, timeout_s=2), name  # plaintext
        with make_channel(launcher.trainer_address, auth=pki.auth()) as channel:  # no token
            with pytest.raises(grpc.RpcError) as err:
                trainer_pb2_grpc.TrainerStub(channel).RegisterSampler(
                    trainer_pb2.RegisterSamplerRequest(address="127.0.0.1:1"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wait_for(lambda: status_step(launcher) >= 2, 600, "step 2", launcher)
        launcher.procs["trainer"].send_signal(signal.SIGTERM)  # finishes its step, exits 0
        code = wait_exit(launcher, "trainer", 120)
        assert code == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()
    records = trained_records(run_dir)
    assert len(records) >= 2
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for i in range(len(launcher.sampler_addresses)):
        log = log_records(launcher.log_dir / f"sampler-{i}.log")
        assert any(r.get("msg") == "registered with the trainer" for r in log), i
        assert not any(r.get("msg") == "rollout failed" for r in log), i  # scoring worked
