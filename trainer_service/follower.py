"""A follower's run (multi-host, every process but 0): the leader's collectives, on its word.

A follower holds the same :class:`~trainer_service.policy.Policy` as the leader (mesh, learner,
checkpoints) and nothing that talks to the world: no data, samplers, evaluation or metrics
files. It resumes from the same checkpoint, then carries out the leader's control messages
(``multihost.py``) until it says stop. Its ``Status`` (the health service's view) follows the
leader's step as far as a follower learns it: from the checkpoints it is told to save.
"""

from __future__ import annotations

from pathlib import Path

from splitrl.config import Config
from splitrl.logs import set_context
from trainer_service.learning.multihost import HostGroup, Message
from trainer_service.policy import Policy
from trainer_service.resume import check_resume
from trainer_service.run import RunState


class FollowerRun:
    def __init__(self, cfg: Config, hosts: HostGroup):
        self.cfg = cfg
        self.hosts = hosts
        run_dir = Path(cfg.trainer.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.status = RunState(total_steps=cfg.trainer.steps)
        self.policy = Policy(cfg, hosts)
        restored = self.policy.restore(lambda meta: check_resume(cfg, meta, str(run_dir)))
        if restored is not None:
            self.status.step, self.status.version = restored[0].step, self.policy.version

    def run(self) -> dict[str, float]:
        self.status.state = "training"

        def on_message(message: Message) -> None:
            self.status.version = self.policy.version
            if message.op == "checkpoint":  # the leader's step, as far as a follower knows it
                self.status.step = message.step
                set_context(step=message.step)

        try:
            ok = self.policy.follow(on_message)
            self.status.state = "done" if ok else "failed"
            return {}
        except Exception:
            self.status.state = "failed"
            raise
        finally:
            self.policy.close()
