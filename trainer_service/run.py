"""The trainer's run: pull scored groups, update the policy, push weights, checkpoint.

One step reads like the algorithm::

    groups  = buffer.take(prompts_per_step, version, max_staleness)   # pulled from samplers
    batch   = build_train_batch(groups)                                 # group-normalised adv.
    metrics = learner.train_step(batch)                                 # loss -> optax update
    version += 1; publisher.push_all(params, version)                   # resharded per sampler
    checkpoint every N steps (params, opt state, step, version, data cursor, unfinished prompts)

Choices, all in the config: ``trainer.max_staleness`` (0 = on-policy and synchronous; k > 0
keeps rollouts for the next k steps in flight while training, and drops groups older than k
versions), ``algorithm.*`` (loss variant, clipping, aggregation, KL, importance-sampling cap),
``algorithm.filter_zero_variance`` (dynamic sampling), ``trainer.push_every``.

Nothing is lost: prompts drawn from the data but not yet trained on (queued, in flight, or
buffered) are saved with every checkpoint and re-queued first on resume; a sampler's failure
re-queues its prompts (see ``dispatcher.py``). Every trained prompt uid is appended to
``trained_prompts.jsonl`` so a run can be audited for exactly-once training.

Multi-host (several JAX processes, see ``multihost.py``): process 0 runs this loop; every other
process builds the same mesh and learner and follows it, making the same collective calls
(train step, gather for a push, checkpoint) in the same order. The ``self.hosts`` calls below
are those hand-offs; with one process they do nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from splitrl.config import Config, dump_config, to_dict
from splitrl.logs import set_context
from splitrl.mesh import build_mesh
from splitrl.models import from_pretrained
from splitrl.serving import auth_metadata
from splitrl.tokenizer import load_tokenizer
from trainer_service.learning.batching import build_train_batch
from trainer_service.learning.checkpoints import Checkpointer
from trainer_service.learning.export import export_hf
from trainer_service.learning.learner import Learner
from trainer_service.learning.multihost import HostGroup, follow, host_model
from trainer_service.orchestration.data import PromptStream
from trainer_service.orchestration.dispatcher import Dispatcher
from trainer_service.orchestration.evaluation import accuracy_function, evaluate
from trainer_service.orchestration.membership import SamplerHandle, SamplerPool
from trainer_service.orchestration.publisher import WeightPublisher
from trainer_service.orchestration.reward_checks import RewardChecks, RewardFunctionFailed
from trainer_service.orchestration.rollouts import RolloutBuffer, RolloutGroup, WorkItem

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


class TrainerRun:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        tcfg = cfg.trainer
        self.hosts = HostGroup.current()  # process 0 leads; one process: the leader, alone
        self.run_dir = Path(tcfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.hosts.is_leader:
            dump_config(cfg, self.run_dir / "config.yaml")
        self.status = RunState(total_steps=tcfg.steps)
        self.stop_event = threading.Event()
        self.metadata = auth_metadata(cfg.services.auth)

        # Every process: the global mesh, the learner and its checkpoints.
        self.mesh = build_mesh(tcfg.mesh)
        model = from_pretrained(cfg.model.path, dtype=cfg.model.dtype)
        self.learner = Learner(
            model,
            algorithm=cfg.algorithm,
            optimizer=tcfg.optimizer,
            mesh=self.mesh,
            strategy=tcfg.mesh.strategy,
            micro_batch_size=tcfg.micro_batch_size,
            epochs_per_batch=tcfg.epochs_per_batch,
            temperature=cfg.sampling.temperature or 1.0,
            logprob_chunk_size=cfg.model.logprob_chunk_size,
        )
        self.checkpointer = Checkpointer.from_config(tcfg.checkpoint, self.run_dir)
        self.version = 0
        self.step = 0
        self.drawn = 0  # prompts drawn from the data so far: makes every work item's uid unique
        self._params_lock = threading.Lock()
        if self.hosts.is_leader:
            self._init_leader()
        self._restore()

    def _init_leader(self) -> None:
        """The leader's parts: data, samplers, rollouts, weight pushes, metrics files."""
        cfg, tcfg = self.cfg, self.cfg.trainer
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.data = PromptStream.for_run(cfg, tokenizer=self.tokenizer)
        self.reward_checks = RewardChecks.from_config(cfg.reward)
        self.pool = SamplerPool(
            cfg.services,
            max_message_bytes=2 * cfg.sampler.max_chunk_bytes + (1 << 20),
            on_join=self._on_sampler_join,
            on_leave=self._on_sampler_leave,
        )
        self.buffer = RolloutBuffer(on_requeue=lambda item: self.dispatcher.requeue(item))
        self.dispatcher = Dispatcher(
            self.pool,
            self.buffer,
            group_size=cfg.algorithm.group_size,
            sampling=cfg.sampling,
            min_version=lambda: self.version - tcfg.max_staleness,
            metadata=self.metadata,
        )
        self.publisher = WeightPublisher(self.pool, metadata=self.metadata)
        names = [f.name for f in cfg.reward.functions]
        self.accuracy_fn = accuracy_function(names)
        self.metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        self.trained_file = (self.run_dir / "trained_prompts.jsonl").open("a")

    # -- membership callbacks -------------------------------------------------------------

    def _host_params(self):
        with self._params_lock:
            if self.hosts.multi:  # a collective cannot start on this thread: the last gather
                return self.hosts.gathered
            return jax.device_get(self.learner.params), self.version

    def _params_for_push(self):
        """The params as the weight sender reads them: straight from the devices (one
        process), or gathered to this host together with the followers (multi-host)."""
        return self.hosts.params_for_push(self.learner.params, self.version)

    def _on_sampler_join(self, handle: SamplerHandle) -> None:
        """A new sampler gets the current weights before it gets work."""
        params, version = self._host_params()
        result = self.publisher.push_one(handle, params, version, reset=True,
                                         unless_current=True)
        log.info("sampler synced", extra={"address": handle.address, "ok": result.ok,
                                          "version": version, "error": result.error})

    def _on_sampler_leave(self, handle: SamplerHandle, why: str) -> None:
        self.dispatcher.cancel_sampler(handle)

    # -- checkpoint / resume --------------------------------------------------------------

    def _restore(self) -> None:
        if self.checkpointer.latest_step() is None:
            return
        ckpt = self.checkpointer.restore(self.learner.abstract_train_state())
        self.learner.load_train_state(ckpt.state, ckpt.step)
        self.step, self.version = ckpt.step, ckpt.weight_version
        if not self.hosts.is_leader:
            return  # the data cursor is the leader's
        cursor = ckpt.data_cursor
        self.data.load_state_dict(cursor["stream"])
        self.drawn = int(cursor["drawn"])
        unfinished = [WorkItem.from_json(d) for d in cursor["unfinished"]]
        self.dispatcher.submit(unfinished)
        log.info("resumed from checkpoint", extra={
            "step": self.step, "version": self.version, "data_cursor": cursor["stream"],
            "requeued": len(unfinished)})

    def _checkpoint(self, force: bool = False) -> None:
        """Params, optimizer state, step, version and the data position, which includes the
        prompts drawn but not yet trained on (queued, in flight or buffered)."""
        if not (force or self.checkpointer.should_save(self.step)):
            return
        # Dispatcher first: a group moving into the buffer meanwhile is then seen twice (and
        # de-duplicated), never missed. Buffer -> dispatcher moves only happen on this thread.
        unfinished = {i.uid: i for i in self.dispatcher.unfinished_items()}
        unfinished.update({i.uid: i for i in self.buffer.pending_items()})
        cursor = {
            "stream": self.data.state_dict(),
            "drawn": self.drawn,
            "unfinished": [i.to_json() for i in unfinished.values()],
        }
        self.hosts.checkpoint(self.step, self.version)  # followers save their shards too
        self.checkpointer.save(self.step, self.learner.train_state(),
                               weight_version=self.version, data_cursor=cursor,
                               config=to_dict(self.cfg), force=True)

    # -- the loop -------------------------------------------------------------------------

    def _feed(self) -> None:
        """Keep (1 + max_staleness) steps of prompts queued or in flight."""
        tcfg = self.cfg.trainer
        target = (1 + tcfg.max_staleness) * tcfg.prompts_per_step
        if not self.cfg.algorithm.filter_zero_variance:
            # Prompts for steps beyond the end of the run are not drawn. (Dynamic sampling
            # over-samples instead: filtered prompts must be replaced.)
            target = min(target, (tcfg.steps - self.step) * tcfg.prompts_per_step)
        want = target - self.dispatcher.outstanding() - len(self.buffer)
        if want > 0:
            rows = self.data.next_batch(want)
            items = [WorkItem(uid=f"{r['prompt_id']}#{self.drawn + i}", row=r)
                     for i, r in enumerate(rows)]
            self.drawn += len(rows)
            self.dispatcher.submit(items)

    def _wait_for_samplers(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not [h for h in self.pool.ready() if h.weight_version >= self.version]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no sampler became ready within {timeout_s:.0f}s")
            if self.stop_event.wait(0.2):
                raise InterruptedError("stopped while waiting for samplers")

    def _evaluate(self, tag: str) -> dict[str, float]:
        data = self.cfg.trainer.data
        rows = self.data.eval_rows(data.eval_size)
        if not rows:
            return {}
        self.status.state = "evaluating"
        self._wait_for_samplers()
        result = evaluate(self.pool, rows, self.cfg.sampling, min_version=self.version,
                          accuracy_fn=self.accuracy_fn, metadata=self.metadata)
        result = {f"{tag}/{k.split('/', 1)[1]}": v for k, v in result.items()}
        self._write_metrics({"step": self.step, "version": self.version, **result})
        log.info("evaluation", extra=result)
        return result

    def _write_metrics(self, record: dict) -> None:
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def _group_metrics(self, groups: list[RolloutGroup]) -> dict[str, float]:
        rewards = np.concatenate([g.rewards for g in groups])
        staleness = [self.version - g.weight_version for g in groups]
        lengths = [len(c.token_ids) for g in groups for c in g.completions]
        out = {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": float(np.max(staleness)),
            "completion_len/mean": float(np.mean(lengths)),
        }
        if self.accuracy_fn:
            acc = [c.rewards.get(self.accuracy_fn, 0.0) for g in groups for c in g.completions]
            out["accuracy/mean"] = float(np.mean(acc))
        return out

    def train_step(self) -> dict[str, float]:
        tcfg = self.cfg.trainer
        t0 = time.monotonic()
        self._feed()
        groups = self.buffer.take(
            tcfg.prompts_per_step, self.version, tcfg.max_staleness,
            should_stop=self.stop_event.is_set,
            while_waiting=self._feed,
        )
        t_rollouts = time.monotonic()
        try:  # failing reward functions: logged, counted, and past the policy the run stops
            reward_metrics = self.reward_checks.observe(groups)
        except RewardFunctionFailed as e:
            self._write_metrics({"step": self.step + 1, "version": self.version, **e.metrics})
            raise
        group_metrics = self._group_metrics(groups)  # staleness against the version used
        batch = build_train_batch(groups, self.cfg.algorithm, pad_id=self.pad_id)
        self.hosts.train(batch)  # multi-host: every process trains on this batch
        with self._params_lock:
            metrics = self.learner.train_step(batch)
            self.version += 1
            self.step += 1
        t_train = time.monotonic()
        if self.step % tcfg.push_every == 0 or self.step == tcfg.steps:
            results = self.publisher.push_all(self._params_for_push(), self.version)
            pushed = [r for r in results if r.ok]
            metrics["push/seconds"] = max((r.seconds for r in pushed), default=0.0)
            metrics["push/mb"] = sum(r.bytes for r in pushed) / 2**20
            metrics["push/failed"] = float(len(results) - len(pushed))
        t_push = time.monotonic()
        self._feed()  # next step's prompts go out while we checkpoint and log
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        metrics.update(group_metrics)
        metrics.update(reward_metrics)
        metrics.update(self.data.length_metrics())
        metrics.update({
            "time/wait_rollouts_s": t_rollouts - t0,
            "time/train_s": t_train - t_rollouts,
            "time/push_s": t_push - t_train,
            "time/step_s": t_push - t0,
            "throughput/tokens_per_s": tokens / max(t_push - t0, 1e-9),
            "samplers/ready": float(len(self.pool.ready())),
            "counts/stale_dropped": float(self.buffer.counts["stale_dropped"]),
            "counts/zero_variance_filtered": float(self.buffer.counts["zero_variance_filtered"]),
            "counts/redispatched": float(self.dispatcher.redispatched),
        })
        self.trained_file.write(json.dumps({
            "step": self.step, "uids": [g.item.uid for g in groups],
            "versions": [g.weight_version for g in groups],
            "samplers": [g.sampler_id for g in groups],
            "trainer_version": self.version - 1,
        }) + "\n")
        self.trained_file.flush()
        self._checkpoint()  # a no-op unless a save is due
        return metrics

    def run(self, progress=None) -> dict[str, float]:
        if not self.hosts.is_leader:
            return self._follow()
        tcfg = self.cfg.trainer
        summary: dict[str, float] = {}
        try:
            if self.hosts.multi:
                self._params_for_push()  # the copy that joining samplers are synced from
            self.pool.start()
            self.dispatcher.start()
            self._wait_for_samplers()
            if tcfg.eval_before and self.step == 0:
                summary.update(self._evaluate("eval_before"))
            self.status.state = "training"
            started = time.monotonic()
            start_step = self.step
            while self.step < tcfg.steps and not self.stop_event.is_set():
                try:
                    metrics = self.train_step()
                except InterruptedError:  # stopped while waiting for rollouts
                    if self.stop_event.is_set():
                        break
                    raise
                set_context(step=self.step, weight_version=self.version)
                elapsed = time.monotonic() - started
                self.status.step, self.status.version = self.step, self.version
                self.status.steps_per_s = (self.step - start_step) / max(elapsed, 1e-9)
                self.status.tokens_per_s = metrics["throughput/tokens_per_s"]
                self.status.last_metrics = metrics
                self.status.data_cursor = self.data.state_dict()
                self._write_metrics({"step": self.step, "version": self.version, **metrics})
                if progress is not None:
                    progress(self.step, metrics)
                if self.step % tcfg.log_every == 0:
                    log.info("step", extra={k: round(v, 5) for k, v in metrics.items()
                                            if k in _LOGGED})
            if self.stop_event.is_set():
                return self._stopped(summary)
            if self.checkpointer.latest_step() != self.step:
                self._checkpoint(force=True)
            if tcfg.eval_after:
                summary.update(self._evaluate("eval_after"))
            export_dir = self.run_dir / "export"
            export_hf(self._policy_model(), export_dir, source_dir=self.cfg.model.path)
            summary["step"] = float(self.step)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            self.status.state = "done"
            return summary
        except InterruptedError:
            if not self.stop_event.is_set():
                self.status.state = "failed"
                raise
            return self._stopped(summary)
        except Exception:
            self.status.state = "failed"
            raise
        finally:
            self.close()

    def _stopped(self, summary: dict[str, float]) -> dict[str, float]:
        """Stopped by a signal: checkpoint where we are, so the next start resumes here."""
        if self.step > 0 and self.checkpointer.latest_step() != self.step:
            self._checkpoint(force=True)
        self.status.state = "stopped"
        log.info("stopped; resume continues from this step",
                 extra={"step": self.step, "version": self.version})
        return summary

    def _policy_model(self):
        """The current policy as an nnx model on this host (for the export)."""
        if not self.hosts.multi:
            return self.learner.model()
        params, version = self.hosts.gathered  # the final step's push gathered them
        if version != self.version:
            params = self._params_for_push()
        return host_model(self.learner, params)

    def _follow(self) -> dict[str, float]:
        """A follower's run: the leader's train steps, gathers and checkpoints, on its word."""
        self.status.state = "training"

        def on_message(message):
            self.status.step = self.learner.step
            set_context(step=self.learner.step)

        try:
            ok = follow(self.hosts, self.learner, self.checkpointer, on_message)
            self.status.state = "done" if ok else "failed"
            return {}
        except Exception:
            self.status.state = "failed"
            raise
        finally:
            self.close()

    def close(self) -> None:
        if self.hosts.is_leader:
            self.hosts.stop(failed=self.status.state == "failed")  # release the followers
            self.dispatcher.stop()
            self.buffer.close()
            self.pool.stop()
            self.publisher.close()
            self.metrics_file.close()
            self.trained_file.close()
        self.checkpointer.close()


_LOGGED = {
    "loss", "reward/mean", "accuracy/mean", "kl", "entropy", "grad_norm",
    "staleness/max", "time/step_s", "time/wait_rollouts_s",
}
