"""Nothing is lost: a sampler killed with SIGKILL, a sampler joining mid-run and a SIGTERM
resume. A trainer killed and resumed from its checkpoint, bitwise the uninterrupted run:
tests/e2e/test_reproducible.py."""

from __future__ import annotations

import signal
from collections import Counter

import grpc
import pytest

from splitrl.jsonl import read_jsonl
from splitrl.serving import make_channel
from splitrl.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from splitrl_app.launch.ports import free_port
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    kill_service,
    log_records,
    run_config,
    status_step,
    tail,
    trained_records,
    wait_exit,
    wait_for,
)

pytestmark = pytest.mark.slow

FAST = ("trainer.eval_before=false", "trainer.eval_after=false")


def test_a_sampler_killed_a_sampler_joining_and_a_sigterm_resume_lose_no_prompt(arith_model,
                                                                               tmp_path):
    """One asynchronous run (max_staleness = 1) with a shared auth token on every service: calls
    without the token are refused; sampler-0 is killed with SIGKILL, a sampler started mid-run
    joins and gets work, a sampler with other settings is refused; then the trainer is stopped
    with SIGTERM (Ctrl-C), finishes its step, checkpoints it, exits 0, and the next start
    continues from exactly there for RESUMED more steps. Across all of it every prompt of the
    run is trained exactly once, every step once, no group more than one version stale. (One
    run for what were two tests, each starting its own services: the sampler faults, and the
    staleness bound with auth across a SIGTERM and resume.)"""
    run_dir = tmp_path / "run"
    # The newcomer joins mid-run: the trainer is paused while it starts (see below); the
    # SIGTERM follows as soon as it has trained on the newcomer's work and refused the
    # stranger, with most of the 150 steps still to run. The restart asks for fewer: the run
    # ends RESUMED steps after the stop (a resume may change trainer.steps), not at 150.
    steps, per_step, resumed_steps = 150, 8, 4
    cfg = run_config(arith_model, run_dir, f"trainer.steps={steps}",
                     f"trainer.prompts_per_step={per_step}", "trainer.max_staleness=1",
                     "trainer.checkpoint.every=1000", "services.auth.token=s3cret", *FAST)
    launcher = Launcher(cfg)
    try:
        launcher.up()
        # As soon as the trainer answers (a trainer that had finished would answer
        # UNAVAILABLE instead).
        wait_for(lambda: status_step(launcher) >= 0, 300, "the trainer to answer", launcher)
        with make_channel(launcher.trainer_address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                trainer_pb2_grpc.TrainerStub(channel).RegisterSampler(
                    trainer_pb2.RegisterSamplerRequest(address="127.0.0.1:1"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with make_channel(launcher.sampler_addresses[0]) as channel:
            header = sampler_pb2.WeightPushMessage(header=sampler_pb2.PushHeader(version=10**6))
            with pytest.raises(grpc.RpcError) as err:
                sampler_pb2_grpc.SamplerStub(channel).PushWeights(iter([header]), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        wait_for(lambda: status_step(launcher) >= 4, 300, "step 4", launcher)
        kill_service(launcher, "sampler-0")
        # A sampler started mid-run registers itself, receives the weights, then gets work.
        # The trainer is paused while the newcomer starts (tens of seconds of imports and
        # compilation), so the run cannot end before it is up, however loaded the machine.
        # Beside it, a sampler started by hand with other stop tokens (issue 31, 2): it must
        # be refused when it registers, naming the key, and never get work.
        trainer = launcher.procs["trainer"]
        trainer.send_signal(signal.SIGSTOP)
        try:
            newcomer = launcher.start_sampler(2)
            stranger_port = free_port()
            launcher.ports.append(stranger_port)  # released when the launch stops
            stranger = f"127.0.0.1:{stranger_port}"
            launcher.start("sampler-3", "sampler", [f"services.sampler_port={stranger_port}",
                                                    "run_name=stranger",
                                                    "sampling.stop_token_ids=[5]"],
                           cfg.sampler.mesh.devices_needed())
            launcher.wait_healthy("sampler-2", newcomer)
            launcher.wait_healthy("sampler-3", stranger)
        finally:
            trainer.send_signal(signal.SIGCONT)

        def newcomer_ready():
            try:
                status = launcher.status()
            except grpc.RpcError:
                return None
            return any(s.address == newcomer and s.healthy for s in status.samplers) and status

        status = wait_for(newcomer_ready, 300, "the new sampler to be ready", launcher)
        assert status.step < steps, "the run ended before the new sampler joined"
        assert not any(s.address == launcher.sampler_addresses[0] and s.healthy
                       for s in status.samplers), "the killed sampler is still listed healthy"
        # The stranger registers again and again (every heartbeat): this trainer refuses it.
        refusal = (f"sampler {stranger} refused: its settings differ from the trainer's (start "
                   "it with the trainer's config and model): sampling.stop_token_ids: "
                   "trainer [], sampler [5]")
        wait_for(lambda: refusal in (launcher.log_dir / "trainer.log").read_text(), 120,
                 "the stranger's refusal", launcher)
        trained = run_dir / "trained_prompts.jsonl"  # read while the trainer writes it
        wait_for(lambda: any(_is(newcomer, s) for r in read_jsonl(trained)
                             for s in r["samplers"]), 300,
                 "a step trained on the new sampler's completions", launcher)
        # The killed sampler is dropped once unreachable for services.sampler_timeout_s (10 s):
        # the SIGTERM waits for it, or a run quick to reach the newcomer's work stops first.
        wait_for(lambda: '"sampler dropped"' in (launcher.log_dir / "trainer.log").read_text(),
                 120, "the killed sampler to be dropped", launcher)
        # Ctrl-C / SIGTERM: the trainer finishes its step, checkpoints it and exits 0.
        launcher.procs["trainer"].send_signal(signal.SIGTERM)
        assert wait_exit(launcher, "trainer", 120) == 0, tail(launcher.log_dir / "trainer.log")
        stopped = [r for r in log_records(launcher.log_dir / "trainer.log")
                   if r.get("msg", "").startswith("stopped")]
        assert stopped, tail(launcher.log_dir / "trainer.log")
        stop_step = stopped[-1]["step"]
        assert stop_step < steps, "the run ended before the SIGTERM"
        assert (run_dir / "checkpoints" / str(stop_step)).is_dir()
        steps = stop_step + resumed_steps
        launcher.start_trainer((f"trainer.steps={steps}",))
        assert wait_exit(launcher, "trainer", 600) == 0, tail(launcher.log_dir / "trainer.log")
    finally:
        launcher.stop()
    trainer_log = log_records(launcher.log_dir / "trainer.log")  # both trainers'
    resumed = [r for r in trainer_log if r.get("msg") == "resumed from checkpoint"]
    assert "the trainer refused this sampler" in (launcher.log_dir / "sampler-3.log").read_text()
    assert resumed and resumed[-1]["step"] == stop_step

    records = trained_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), (
        "every step exactly once across the stop")
    uids = [u for r in records for u in r["uids"]]
    duplicates = [u for u, n in Counter(uids).items() if n > 1]
    assert not duplicates, f"prompts trained twice: {duplicates}"
    assert len(uids) == steps * per_step, "every prompt of the run is trained on exactly once"
    assert sorted(int(u.rsplit("#", 1)[1]) for u in uids) == list(range(steps * per_step))
    staleness = [r["trainer_version"] - v for r in records for v in r["versions"]]
    assert max(staleness) <= 1 and min(staleness) >= 0
    print(f"staleness histogram: {Counter(staleness)}")

    by_sampler = Counter(s for r in records for s in r["samplers"])
    assert any(_is(newcomer, s) for s in by_sampler), (
        f"the sampler started mid-run got no work: {by_sampler}"
    )
    assert "stranger" not in by_sampler, by_sampler  # refused: never given a prompt
    assert any(r.get("msg") == "sampler dropped" for r in trainer_log)
    assert any(r.get("msg") == "sampler synced" and r.get("ok") and
               r.get("served_before") == "the weights of its own model.path" and
               r.get("address", "").endswith(newcomer.rsplit(":", 1)[1]) for r in trainer_log)


def _is(address: str, sampler_id: str) -> bool:
    """Whether ``sampler_id`` (a trained record's) names the sampler at ``address``."""
    return sampler_id == address or address.endswith(sampler_id.rsplit(":", 1)[-1])
