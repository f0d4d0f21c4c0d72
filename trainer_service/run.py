"""The leader's run: pull scored groups, update the policy, push weights, checkpoint.

One step reads like the algorithm::

    groups  = collect(prompts_per_step)       # rollouts from the samplers, in draw order
    batch   = build_train_batch(groups)       # group-normalised advantages
    metrics = update(batch)                   # loss -> optax update: the next weight version
    push()                                    # the new weights to every sampler, resharded
    draw_ahead(); record(); checkpoint()      # next prompts out, audit trail, every N steps

Choices, all in the config: ``trainer.max_staleness`` (0 = on-policy and synchronous, and then
the run is a function of its config and seed; k > 0 keeps rollouts for the next k steps in
flight while training and drops groups older than k versions), ``algorithm.*`` (estimator, loss
variant, clipping, aggregation, KL, importance-sampling cap, dynamic sampling),
``trainer.push_every``.

Nothing is lost: every drawn prompt belongs to the rollout queue (``queue.py``) until it is
trained on, filtered or dropped; its unfinished items are saved with every checkpoint and
queued first on resume; the audit trail (``audit.py``) lists every trained prompt once.

The pieces, one concern each: :class:`~trainer_service.policy.Policy` holds the learner, its
checkpoints and the host group (every process has one); ``prompt_feed.py`` draws the prompts
and collects a step's groups; ``orchestration/parts.py`` wires the samplers, the queue and the
publisher; ``RunEvaluation`` (``orchestration/evaluation.py``) runs the greedy evaluations;
``step_metrics.py`` turns a step's rollouts into metrics. This module owns the step count, the
order of a step, when to push, and how the run ends (``summary.json``).

Multi-host (several JAX processes, see ``multihost.py``): process 0 runs this loop; every other
process runs ``follower.py``, making the same collective calls (train step, gather for a push,
checkpoint) in the same order, on the leader's word. With one process there is only the leader.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitrl.agreement import agreed_settings
from splitrl.auth import auth_metadata
from splitrl.config import Config, dump_config
from splitrl.jsonl import JsonlAppender
from splitrl.logs import set_context
from splitrl.models import param_shapes
from splitrl.retry import wait_until
from splitrl.tokenizer import decode, load_tokenizer
from trainer_service.learning.batching import batch_length, build_train_batch
from trainer_service.learning.checkpoints import SaveFailed
from trainer_service.learning.multihost import HostGroup
from trainer_service.orchestration.evaluation import RunEvaluation, accuracy_function
from trainer_service.orchestration.identity import ModelIdentity
from trainer_service.orchestration.membership import NoUsableSampler
from trainer_service.orchestration.parts import build_leader_parts
from trainer_service.orchestration.prompt_length import token_counter
from trainer_service.orchestration.publisher import PushInFlight, PushResult, push_metrics
from trainer_service.orchestration.reward_checks import RewardChecks, RewardFunctionFailed
from trainer_service.policy import Policy
from trainer_service.prompt_feed import Collected, PromptFeed
from trainer_service.resume import check_resume
from trainer_service.step_metrics import LOGGED, rollout_metrics
from trainer_service.tracking import Trackers

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What ``Status`` reports; written by the loop, read by the gRPC server."""

    state: str = "starting"
    step: int = 0
    total_steps: int = 0
    version: int = 0
    tokens_per_s: float = 0.0
    steps_per_s: float = 0.0
    last_metrics: dict[str, float] = field(default_factory=dict)
    data_cursor: dict = field(default_factory=dict)


class LeaderRun:
    """Process 0's run (the only one with one process): everything that talks to the world."""

    def __init__(self, cfg: Config, hosts: HostGroup):
        self.cfg = cfg
        tcfg = cfg.trainer
        self.hosts = hosts
        self.run_dir = Path(tcfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # This attempt's summary, written when it ends: never an earlier attempt's.
        (self.run_dir / "summary.json").unlink(missing_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")
        self.status = RunState(total_steps=tcfg.steps)
        self.stop_event = threading.Event()
        self.stop_reason = ""  # why the run stopped or failed, for summary.json
        self._mid_step = False  # between a step's update and its audit record
        # The step's rollouts taken from the queue and not yet in the audit trail: a checkpoint
        # before the update (a stop by the reward error policy) lists them as unfinished.
        self._holding: Collected | None = None
        self.metadata = auth_metadata(cfg.services.auth)

        self.policy = Policy(cfg, hosts)
        self.checkpointer = self.policy.checkpointer  # the policy's; saves go through policy.save
        self.step = 0  # steps run, with or without an update; the weight version is the learner's
        self._push_in_flight: PushInFlight | None = None
        self._pushed_version = 0
        self._last_step_end: float | None = None  # monotonic time the previous step ended
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.tokenizer_class)
        self.pad_id = self.tokenizer.pad_token_id or 0
        learner = self.policy.learner
        self.parts = build_leader_parts(cfg, tokenizer=self.tokenizer,
                                        metadata=self.metadata, run_dir=self.run_dir,
                                        current_weights=self.policy.current_weights,
                                        identity=ModelIdentity.of(
                                            learner.config.architecture,
                                            param_shapes(learner.config),
                                            learner.base_fingerprint,
                                            agreed_settings(cfg, learner.config,
                                                            self.tokenizer)),
                                        lora=learner.lora)
        self.data, self.queue, self.pool = self.parts.data, self.parts.queue, self.parts.pool
        # Every wait for rollouts gives up once no sampler has been ready for
        # services.sampler_wait_s (NoUsableSampler): the run stops, checkpointed, saying why.
        self.feed = PromptFeed(cfg, self.data, self.queue, self.stop_event,
                               check=self.pool.check_usable)
        self.publisher, self.audit = self.parts.publisher, self.parts.audit
        self.accuracy_fn = accuracy_function(cfg)
        self.evaluation = RunEvaluation(cfg, self.data, self.queue, tokenizer=self.tokenizer,
                                        run_dir=self.run_dir, accuracy_fn=self.accuracy_fn,
                                        stop=self.stop_event, check=self.pool.check_usable)
        self.reward_checks = RewardChecks.from_config(cfg.reward)
        self.metrics_file = JsonlAppender(self.run_dir / "metrics.jsonl")
        self.resumed_from: int | None = None
        self._restore()  # refuses a checkpoint of another config before anything else starts
        self.trackers = Trackers.from_config(cfg, self.run_dir, self.accuracy_fn)

    @property
    def version(self) -> int:
        """The weight version: the learner's count of updates (its one owner). A step with
        nothing to train on leaves it, so it may trail ``step``; the queue, the pushes, the
        status and the checkpoint read it from here."""
        return self.policy.version

    # -- one step -------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        t0 = time.monotonic()
        trained_from = self.version  # the weights this step's rollouts are trained against
        # Between the previous step's push and now: drawing, the audit record, a checkpoint,
        # metrics. With max_staleness 0 the samplers generate meanwhile, so a step's rollouts
        # take wait + other: both belong to the step's cost (bench/step_breakdown.py).
        between = t0 - self._last_step_end if self._last_step_end is not None else 0.0
        collected = self._holding = self.feed.collect(self.cfg.trainer.prompts_per_step,
                                                        self.step)
        t_rollouts = time.monotonic()
        if self.trackers.completions_due(self.step + 1):
            self.trackers.completions(  # prompts as the model saw them: their token ids
                self.step + 1, collected.groups,
                decode=lambda ids: decode(self.tokenizer, ids, skip_special_tokens=False))
        metrics = rollout_metrics(collected, self.queue.counts, self.version, self.accuracy_fn)
        try:  # failing reward functions: logged, counted, and past the policy the run stops
            metrics.update(self.reward_checks.observe(collected.groups))
        except RewardFunctionFailed as e:
            self._write_metrics({"step": self.step + 1, "version": self.version, **metrics,
                                 **e.metrics})
            raise
        metrics.update(self.data.length_metrics())
        self._mid_step = True  # until the audit records it, a checkpoint would lose this step
        if collected.groups:
            batch = build_train_batch(collected.groups, self.cfg.algorithm, pad_id=self.pad_id,
                                      longest=self._longest_row())
            metrics.update(self.policy.train(batch))  # the learner may skip it ("skipped")
            self.queue.set_version(self.version)
        else:  # nothing with signal within the bounds: a step without an update
            metrics["skipped"] = 1.0
        self.step += 1
        t_train = time.monotonic()
        metrics.update(self._push())
        t_push = self._last_step_end = time.monotonic()
        self.feed.draw_ahead(self.step)  # the next prompts go out while we record, checkpoint
        self.audit.record(self.step, trained_from, collected.groups, filtered=collected.filtered,
                          dropped=collected.dropped)
        self._mid_step, self._holding = False, None
        tokens = sum(len(c.token_ids) for g in collected.groups for c in g.completions)
        metrics.update({
            "time/wait_rollouts_s": t_rollouts - t0,
            "time/train_s": t_train - t_rollouts,
            "time/push_s": t_push - t_train,
            "time/step_s": t_push - t0,
            "time/other_s": between,
            "time/interval_s": between + t_push - t0,
            "throughput/tokens_per_s": tokens / max(t_push - t0, 1e-9),
            "samplers/ready": float(len(self.pool.ready())),
        })
        return metrics

    def _push(self) -> dict[str, float]:
        tcfg = self.cfg.trainer
        due = self.step % tcfg.push_every == 0 or self.step == tcfg.steps
        if not due or self.version == self._pushed_version:
            return {}
        # With max_staleness >= 1 the push goes in the background (samplers serve the old
        # version until their swap; the next update does not wait), one push at a time.
        waited = time.monotonic()
        results = self._finish_push()
        if tcfg.max_staleness >= 1:
            self._push_in_flight = self.publisher.push_all_async(self.policy.params_for_push(),
                                                                 self.version)
        else:
            results = self.publisher.push_all(self.policy.params_for_push(), self.version)
        self._pushed_version = self.version
        finished = push_metrics(results) if results is not None else {}  # none finished yet
        return {"time/push_wait_s": time.monotonic() - waited, **finished}

    def _finish_push(self) -> list[PushResult] | None:
        """Wait for the push in the background, if any; its results."""
        in_flight, self._push_in_flight = self._push_in_flight, None
        return in_flight.wait() if in_flight is not None else None

    def _longest_row(self) -> int | None:
        """The most tokens a train row can have: the longest train prompt (the length check
        measured them all) plus the generation budget; None when not measured."""
        report = self.data.length_reports.get("train")
        if report is None or report.longest == 0:
            return None
        return report.longest + self.cfg.sampling.max_new_tokens

    def _start_warm_up(self) -> threading.Thread | None:
        """Compile the train step for the batch shape the next step will most likely have, in
        the background while the samplers start and generate: every prompt's group, and the
        longest of the prompts it draws plus the full generation budget. (Not the split's
        longest prompt: where prompt lengths vary, as in GSM8K, the first batches are mostly
        of a shorter bucket, and a program compiled for the longest would go unused.)"""
        longest = self._longest_row()
        if longest is None:
            return None
        tcfg = self.cfg.trainer
        prompts = self.data.peek(tcfg.prompts_per_step)
        if not prompts:
            return None
        served = token_counter(self.tokenizer, lambda row: row)  # peek's rows are formatted
        first = max(served(prompts)) + self.cfg.sampling.max_new_tokens
        rows = tcfg.prompts_per_step * self.cfg.algorithm.group_size
        return self.policy.start_warm_up(rows, batch_length(first, longest))

    # -- metrics and evaluation -----------------------------------------------------------

    def _write_metrics(self, record: dict) -> None:
        self.metrics_file.write(record)
        self.trackers.log(record)

    def _report(self, metrics, progress, started: float, start_step: int) -> None:
        set_context(step=self.step, weight_version=self.version)
        elapsed = time.monotonic() - started
        self.status.step, self.status.version = self.step, self.version
        self.status.steps_per_s = (self.step - start_step) / max(elapsed, 1e-9)
        self.status.tokens_per_s = metrics["throughput/tokens_per_s"]
        self.status.last_metrics = metrics
        self.status.data_cursor = self.data.state_dict()
        if progress is not None:
            progress(self.step, metrics)
        if self.step % self.cfg.trainer.log_every == 0:
            log.info("step", extra={k: round(v, 5) for k, v in metrics.items() if k in LOGGED})

    def _evaluate(self, tag: str) -> dict[str, float]:
        """Greedy pass@1 on the evaluation rows, through the samplers (the eval lane)."""
        rows = self.evaluation.rows()
        if not rows:
            return {}
        state, self.status.state = self.status.state, "evaluating"
        self._wait_for_samplers()
        result = self.evaluation.evaluate(rows, tag, self.step)
        self.status.state = state
        self._write_metrics({"step": self.step, "version": self.version, **result})
        log.info("evaluation", extra=result)
        return result

    def _wait_for_samplers(self) -> None:
        wait_until(lambda: [h for h in self.pool.ready() if h.weight_version >= self.version],
                   timeout_s=self.cfg.services.sampler_wait_s, stop=self.stop_event,
                   what="a sampler ready (services.sampler_wait_s)",
                   check=self.pool.check_usable)

    # -- checkpoint / resume --------------------------------------------------------------

    def _restore(self) -> None:
        restored = self.policy.restore(
            lambda meta: check_resume(self.cfg, meta, str(self.run_dir)))  # same run only
        if restored is None:  # a start from step 0: earlier records are redone
            rolled_back = self.audit.roll_back_to(0)
            if rolled_back:
                log.warning("no checkpoint: training from step 0; the audit trail's earlier "
                            "records are rolled back",
                            extra={"rolled_back_records": rolled_back, "console": True})
            return
        ckpt, skipped = restored
        self.resumed_from = self.step = ckpt.step
        # Status says the resumed step from now on, not 0 until the first new step is done.
        self.status.step, self.status.version = self.step, self.version
        self.queue.set_version(self.version)
        requeued = self.feed.restore(ckpt.data_cursor)
        rolled_back = self.audit.roll_back_to(self.step)
        log.info("resumed from checkpoint", extra={
            "step": self.step, "version": self.version,
            "data_cursor": ckpt.data_cursor["stream"], "requeued": requeued,
            "rolled_back_records": rolled_back})
        if skipped:
            newest = skipped[0][0]
            log.warning(
                f"checkpoint step {newest} is unreadable ({skipped[0][1]}); resumed from step "
                f"{self.step}, the newest intact one: {newest - self.step} step(s) more to "
                f"train again than from step {newest}; {rolled_back} audit record(s) rolled "
                "back", extra={"skipped": [s for s, _ in skipped], "console": True})

    def _checkpoint(self, force: bool = False) -> None:
        """Params, optimizer state, step, version and the data position, which includes the
        prompts drawn but not yet trained on (queued, in flight or buffered)."""
        if force or self.checkpointer.should_save(self.step):
            self.policy.save(self.step, self.feed.cursor(self._holding))

    def _save_now(self) -> None:
        """Checkpoint the current step unless it is saved already, or the state is
        between an update and its audit record (a checkpoint there would lose the step)."""
        if self.step > 0 and not self._mid_step and self.checkpointer.latest_step() != self.step:
            self._checkpoint(force=True)

    # -- the run --------------------------------------------------------------------------

    def run(self, progress=None) -> dict[str, float]:
        tcfg = self.cfg.trainer
        summary: dict[str, float] = {}
        try:
            if self.hosts.multi:
                self.policy.params_for_push()  # the copy that joining samplers are synced from
            warm_up = self._start_warm_up()
            self.parts.start()
            self._wait_for_samplers()
            if tcfg.eval_before and self.step < tcfg.steps:  # a resumed run: where it starts
                summary.update(self._evaluate("eval_before"))
                summary["eval_before/step"] = float(self.step)
            self.status.state = "training"
            if warm_up is not None:
                self.feed.draw_ahead(self.step)  # the samplers generate the first batch now
                warm_up.join()
            started, start_step = time.monotonic(), self.step
            while self.step < tcfg.steps and not self.stop_event.is_set():
                try:
                    metrics = self.train_step()
                except InterruptedError:  # stopped while waiting for rollouts
                    if self.stop_event.is_set():
                        break
                    raise
                # The step's metrics record, then its checkpoint (a trainer killed after the
                # save has the record of every step the checkpoint holds), then its status.
                self._write_metrics({"step": self.step, "version": self.version, **metrics})
                self._checkpoint()  # a no-op unless a save is due
                self.checkpointer.check_saved()  # a save that failed in the background stops us
                self._report(metrics, progress, started, start_step)
                if self.evaluation.due(self.step):
                    self._evaluate("eval")
            if self.stop_event.is_set():
                return self._stopped(summary)
            if self.checkpointer.latest_step() != self.step:
                self._checkpoint(force=True)
            if tcfg.eval_after:
                summary.update(self._evaluate("eval_after"))
            self.policy.export(self.run_dir / "export")
            self.checkpointer.wait()  # the last checkpoint on disk (or SaveFailed) before "done"
            self.status.state = "done"
            return self._summary(summary)
        except InterruptedError:
            if not self.stop_event.is_set():
                self._failed(summary, "interrupted while not stopping")
                raise
            return self._stopped(summary)
        except RewardFunctionFailed as e:  # the reward error policy stops the run: a clean stop
            self.stop_reason = str(e)  # "stopping the run: reward function ... failed ..."
            self._stopped(summary)
            raise
        except NoUsableSampler as e:  # waiting on would be waiting forever
            self._failed(summary, str(e))  # checkpointed first where the state is consistent
            saved = self.checkpointer.latest_step()
            log.critical(f"{e}. The run stops; "
                         + (f"its checkpoint at step {saved} holds every prompt not yet "
                            f"trained on: run the same command once a sampler can take work, "
                            f"and it resumes from there" if saved else
                            "no step was checkpointed: the same command starts again from step "
                            "0"),
                         extra={"samplers": e.samplers, "console": True})
            raise
        except SaveFailed as e:  # the policy: stop, never train on without checkpoints
            log.critical(f"{e}; the run stops (a run never trains on without the checkpoints it "
                      f"promises). Free the space or fix the permission, then run the same "
                      f"command: it resumes from the last checkpoint "
                      f"(step {self.checkpointer.latest_step() or 0})",
                      extra={"cause": e.cause, "console": True})
            self._failed(summary, str(e), save=False)
            raise
        except Exception as e:
            self._failed(summary, f"{type(e).__name__}: {e}")
            raise
        finally:
            self.close()

    def _stopped(self, summary: dict[str, float]) -> dict[str, float]:
        """A stop the run decided on (a signal, the reward error policy): checkpoint where we
        are, so the next start resumes here."""
        self._save_now()
        self.checkpointer.wait()  # on disk before we say so (SaveFailed: it is not)
        self.status.state = "stopped"
        log.info("stopped; resume continues from this step",
                 extra={"step": self.step, "version": self.version, "reason": self.stop_reason})
        return self._summary(summary)

    def _failed(self, summary: dict, reason: str, save: bool = True) -> None:
        """A fatal error: checkpoint first when the state is consistent (the error came
        between steps), then ``summary.json`` with the reason; the caller re-raises."""
        self.status.state = "failed"
        self.stop_reason = reason
        if save:
            try:
                self._save_now()
                self.checkpointer.wait()
            except Exception:  # the error being reported matters more; this one is logged
                log.exception("no checkpoint after the error")
        try:
            self._summary(summary)
        except OSError as e:  # a full disk may take this too
            log.error("summary.json could not be written", extra={"error": str(e)})

    def _summary(self, summary: dict) -> dict:
        """``summary.json``: how the run ended (done, stopped or failed) and why, at which
        step, from which step it resumed, and its evaluations."""
        summary.update(state=self.status.state, step=float(self.step),
                       total_steps=float(self.cfg.trainer.steps))
        if self.stop_reason:
            summary["reason"] = self.stop_reason
        if self.resumed_from is not None:
            summary["resumed_from"] = float(self.resumed_from)
        path = self.run_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(path)
        return summary

    def close(self) -> None:
        self._finish_push()
        self.hosts.stop(failed=self.status.state == "failed")  # release the followers
        self.parts.close()
        self.metrics_file.close()
        self.trackers.close()
        self.policy.close()
