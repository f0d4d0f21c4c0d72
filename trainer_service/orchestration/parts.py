"""The leader's orchestration parts, built from the config: data, the rollout queue and its
lanes, the sampler pool, the dispatcher, the weight publisher, the join worker and the audit
trail.

Kept apart from ``run.py`` so the loop reads as the algorithm; this is the wiring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitrl.config import Config
from splitrl.models.lora import LoraSpec
from trainer_service.orchestration.audit import AuditLog
from trainer_service.orchestration.data import PromptStream
from trainer_service.orchestration.dispatcher import Dispatcher, sampling_params
from trainer_service.orchestration.identity import ModelIdentity
from trainer_service.orchestration.join_sync import JoinSync
from trainer_service.orchestration.membership import SamplerPool
from trainer_service.orchestration.publisher import WeightPublisher
from trainer_service.orchestration.queue import Lane, RolloutQueue
from trainer_service.orchestration.rollouts import EVAL, TRAIN


def request_size(cfg: Config) -> int:
    """Prompts per request in a synchronous run: a function of the config alone."""
    tcfg = cfg.trainer
    if tcfg.prompts_per_request is not None:
        return tcfg.prompts_per_request
    per_batch = max(1, cfg.sampler.max_batch_size // cfg.algorithm.group_size)
    return max(1, min(per_batch, math.ceil(tcfg.prompts_per_step / 2)))


def lanes(cfg: Config) -> list[Lane]:
    """The training lane (rollouts) and the evaluation lane (one greedy completion)."""
    sync = cfg.trainer.max_staleness == 0
    train = Lane(TRAIN, cfg.algorithm.group_size, sampling_params(cfg.sampling),
                 max_staleness=cfg.trainer.max_staleness,
                 request_size=request_size(cfg) if sync else None,
                 filter_zero_variance=cfg.algorithm.filter_zero_variance)
    evaluation = Lane(EVAL, 1, sampling_params(cfg.sampling, greedy=True), max_staleness=0,
                      request_size=max(1, cfg.sampler.max_batch_size))
    return [train, evaluation]


@dataclass
class LeaderParts:
    data: PromptStream
    queue: RolloutQueue
    pool: SamplerPool
    dispatcher: Dispatcher
    publisher: WeightPublisher
    joins: JoinSync
    audit: AuditLog

    def start(self) -> None:
        self.pool.start()
        self.joins.start()
        self.dispatcher.start()

    def close(self) -> None:
        self.dispatcher.stop()
        self.queue.close()
        self.joins.stop()
        self.pool.stop()
        self.publisher.close()
        self.audit.close()


def build_leader_parts(cfg: Config, *, tokenizer, metadata: tuple, run_dir,
                       current_weights: Callable[[], tuple[Mapping, int]],
                       identity: ModelIdentity | None = None,
                       lora: LoraSpec | None = None) -> LeaderParts:
    """``current_weights()`` returns ``(params, version)`` for samplers that join (pushed by
    the join worker); ``identity`` is the model samplers must serve (others are refused);
    with ``lora`` pushes carry the adapters, for the base checkpoint
    ``identity.base_fingerprint``."""
    data = PromptStream.for_run(cfg, tokenizer=tokenizer)  # long prompts handled here
    queue = RolloutQueue(lanes(cfg))
    pool = SamplerPool(cfg.services,
                       max_message_bytes=2 * cfg.sampler.max_chunk_bytes + (1 << 20),
                       identity=identity)
    dispatcher = Dispatcher(pool, queue, metadata=metadata,
                            rollout_timeout_s=cfg.trainer.rollout_timeout_s)
    publisher = WeightPublisher(pool, metadata=metadata, auth=cfg.services.auth,
                                push=cfg.trainer.push, lora=lora,
                                base_fingerprint=identity.base_fingerprint if identity else None)
    joins = JoinSync(pool, publisher, current_weights)
    return LeaderParts(data, queue, pool, dispatcher, publisher, joins, AuditLog(run_dir))
