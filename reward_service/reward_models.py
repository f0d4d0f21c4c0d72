"""Reward models served in JAX on the reward service's own mesh, batched across requests.

A reward model (``reward.models``) is a sequence classifier
(``splitrl.models.sequence_classifier``). It runs in the server process, not in the scoring
workers: one copy of the weights on ``reward.mesh``, and one thread that owns the device work.
gRPC handler threads tokenize their items (chat template applied) and queue them; the thread
takes everything queued, groups it by padded length and runs forwards of at most
``max_batch_tokens`` (rows x length), so the completions of many groups and of concurrent
requests share a forward.

Why a forward's shape depends only on its length bucket (a power of two of at least 16 tokens,
and as many rows as the budget allows, unused rows padding): a program is compiled per shape,
and a sequence's score must not depend on what else was waiting. XLA:CPU's matmuls round
differently at different row counts, so a lone request and the same request batched with
others would differ in the last bits; at one shape per length, a row's score is the same bits
whoever shares its forward (rows are independent; padding is masked), which keeps a
synchronous run with a reward model bitwise reproducible.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram

from reward_service.pool import Outcome
from splitrl.config import MeshConfig, RewardModelConfig
from splitrl.reward_protocol import ERROR_PREFIX

log = logging.getLogger(__name__)

MIN_BUCKET = 16

BATCH_ROWS = Histogram("splitrl_reward_model_batch_rows", "Sequences per reward-model forward",
                       ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
FORWARD_SECONDS = Histogram(
    "splitrl_reward_model_forward_seconds", "Time of one reward-model forward", ["model"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
MODEL_ERRORS = Counter("splitrl_reward_model_errors_total",
                       "Items a reward model could not score (too long, failed forward)",
                       ["model"])


def length_bucket(n: int) -> int:
    """The padded length of an ``n``-token input: the next power of two, at least 16."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def rows_for(bucket: int, max_batch_tokens: int) -> int:
    """Rows of every forward at ``bucket`` tokens: the most that fit the token budget (at
    least 1: a sequence alone over the budget runs alone)."""
    return max(1, max_batch_tokens // bucket)


def label_scores(graphdef, state, tokens, lengths, *, label: int):
    """The reward model's forward: output ``label`` of the score head for each row [B] (the
    program the service runs, and `splitrl plan` compiles)."""
    from flax import nnx

    return nnx.merge(graphdef, state)(tokens, lengths)[:, label]


def longest_forward(cfg: RewardModelConfig) -> tuple[int, int]:
    """(rows, length) of the largest forward ``cfg`` allows: its longest input's bucket."""
    bucket = length_bucket(cfg.max_length)
    return rows_for(bucket, cfg.max_batch_tokens), bucket


def render(tokenizer, item: dict[str, Any], use_chat_template: bool) -> str:
    """The text a reward model reads for one item: the conversation in its chat template (the
    prompt's messages, or the prompt as a user turn, then the completion as the assistant's),
    else the prompt's text followed by the completion's."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [dict(m) for m in item.get("prompt_messages") or ()] or [
            {"role": "user", "content": item["prompt"]}]
        messages.append({"role": "assistant", "content": item["completion"]})
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return item["prompt"] + item["completion"]


@dataclass
class _Request:
    outcomes: list[Outcome | None]
    remaining: int
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass
class _Sequence:
    request: _Request
    index: int
    ids: list[int]


class RewardModel:
    """One configured reward model: tokenizer, weights on the mesh, and its forward thread."""

    def __init__(self, cfg: RewardModelConfig, mesh_cfg: MeshConfig):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding, PartitionSpec

        from splitrl.mesh import build_mesh, param_shardings
        from splitrl.models.params import param_shapes
        from splitrl.models.sequence_classifier import (
            load_classifier_config,
            load_sequence_classifier,
        )
        from splitrl.tokenizer import load_tokenizer

        self.cfg = cfg
        self.name = cfg.name
        self.description = f"reward model {cfg.path}"
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[cfg.dtype]
        config = load_classifier_config(cfg.path)
        if cfg.label >= config.num_labels:
            raise ValueError(f"reward model {cfg.name!r}: label {cfg.label} is not one of the "
                             f"{config.num_labels} outputs of {cfg.path}")
        self.tokenizer = load_tokenizer(cfg.path, cfg.tokenizer_class)
        self.pad_id = (config.decoder.pad_token_id if config.decoder.pad_token_id is not None
                       else 0)
        mesh = build_mesh(mesh_cfg)
        shardings = param_shardings(mesh, param_shapes(config.decoder), mesh_cfg.strategy)
        model = load_sequence_classifier(cfg.path, dtype, shardings=shardings)
        self._graphdef, self._state = nnx.split(model)
        self._inputs = NamedSharding(mesh, PartitionSpec())
        self._forward = jax.jit(functools.partial(label_scores, label=cfg.label),
                                static_argnums=0)
        self._device_put = jax.device_put
        self._lock = threading.Condition()
        self._waiting: list[_Sequence] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"reward-model-{cfg.name}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def score(self, items: Sequence[dict[str, Any]],
              cancelled: Callable[[], bool] | None = None) -> list[Outcome]:
        """One outcome per item payload (``scoring.Item.payload``); blocks until all are
        scored. An empty input, or one longer than ``max_length``, scores 0 with an error
        reason."""
        request = _Request([None] * len(items), len(items))
        queued = []
        for i, item in enumerate(items):
            ids = self.encode(item)
            if 0 < len(ids) <= self.cfg.max_length:
                queued.append(_Sequence(request, i, ids))
                continue
            MODEL_ERRORS.labels(self.name).inc()
            what = (f"input of {len(ids)} tokens exceeds max_length={self.cfg.max_length}"
                    if ids else "empty input (no prompt and no completion)")
            request.outcomes[i] = Outcome(
                0.0, f"{ERROR_PREFIX}reward model {self.name!r}: {what}", "error")
            request.remaining -= 1
        if not queued:
            return request.outcomes  # type: ignore[return-value]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"reward model {self.name!r} is closed")
            self._waiting.extend(queued)
            self._lock.notify()
        while not request.done.wait(0.2):
            if not self._thread.is_alive():
                raise RuntimeError(f"reward model {self.name!r}'s forward thread has stopped")
            if cancelled is not None and not request.cancelled and cancelled():
                request.cancelled = True
        return request.outcomes  # type: ignore[return-value]

    def encode(self, item: dict[str, Any]) -> list[int]:
        from splitrl.tokenizer import encode_rendered

        return encode_rendered(self.tokenizer,
                               render(self.tokenizer, item, self.cfg.use_chat_template))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ forward thread

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    waiting, self._waiting = self._waiting, []
                    for seq in waiting:
                        self._finish(seq, Outcome(0.0, "cancelled", "cancelled"))
                    return
                waiting, self._waiting = self._waiting, []
            try:
                self._score_all(waiting)
            except Exception as e:  # noqa: BLE001 - never let the forward thread die
                log.exception("reward model forward failed", extra={"model": self.name})
                MODEL_ERRORS.labels(self.name).inc(len(waiting))
                for seq in waiting:
                    self._finish(seq, Outcome(0.0, f"{ERROR_PREFIX}reward model {self.name!r}: "
                                              f"{type(e).__name__}", "error"))

    def _score_all(self, waiting: list[_Sequence]) -> None:
        by_bucket: dict[int, list[_Sequence]] = {}
        for seq in waiting:
            if seq.request.cancelled:
                self._finish(seq, Outcome(0.0, "cancelled", "cancelled"))
            else:
                by_bucket.setdefault(length_bucket(len(seq.ids)), []).append(seq)
        for bucket, seqs in sorted(by_bucket.items()):
            while seqs:
                rows = rows_for(bucket, self.cfg.max_batch_tokens)
                batch, seqs = seqs[:rows], seqs[rows:]
                scores = self._run_forward(batch, rows, bucket)
                for seq, score in zip(batch, scores, strict=False):
                    self._finish(seq, Outcome(float(score), "", "ok"))

    def _run_forward(self, batch: list[_Sequence], rows: int, bucket: int) -> np.ndarray:
        tokens = np.full((rows, bucket), self.pad_id, np.int32)
        lengths = np.ones((rows,), np.int32)  # padding rows: one pad token, score dropped
        for r, seq in enumerate(batch):
            tokens[r, :len(seq.ids)] = seq.ids
            lengths[r] = len(seq.ids)
        start = time.perf_counter()
        out = self._forward(self._graphdef, self._state,
                            self._device_put(tokens, self._inputs),
                            self._device_put(lengths, self._inputs))
        scores = np.asarray(out)
        FORWARD_SECONDS.labels(self.name).observe(time.perf_counter() - start)
        BATCH_ROWS.labels(self.name).observe(len(batch))
        return scores[:len(batch)]

    @staticmethod
    def _finish(seq: _Sequence, outcome: Outcome) -> None:
        request = seq.request
        request.outcomes[seq.index] = outcome
        request.remaining -= 1
        if request.remaining == 0:
            request.done.set()
