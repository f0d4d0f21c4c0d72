"""Request handling behind the sampler's RPCs: validate, encode, generate, score, answer.

:class:`RolloutWorker` turns ``Prompt`` / ``SamplingParams`` messages into engine calls and
engine results into ``Completion`` / ``ScoredGroup`` messages. Every malformed field raises
:class:`RequestError` (INVALID_ARGUMENT naming the field, the value and the expectation).

Sampling parameters follow ``common.proto``: ``temperature`` 0 = greedy (or ``greedy``),
``top_k`` 0 = off, ``top_p`` 0 or 1 = off, ``max_new_tokens`` 0 = ``sampling.max_new_tokens``
from the config, empty ``stop_token_ids`` = the config's, ``has_seed`` false = a fresh random
seed per request (so two requests never repeat each other's samples). A prompt with its own
seed (``Prompt.has_seed``) samples from it whatever request carries it.

Every call's prompts go to the one `GenerationEngine` at once and share its batch with
other calls' (continuous batching); each group reports the weight version it was admitted
under, and each completion the versions it was generated under. A Rollout scores groups in
batches as they finish and streams them as they are scored; ``reproducible`` runs the request
alone in the batch, with no weight update while it generates, so it replays bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import secrets
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sampler_service import metrics
from sampler_service.episodes import Trajectory, tool_calls_json
from sampler_service.requests import (
    EngineClosed,
    FinishedGroup,
    GenerationRequest,
    cut_at_stop_string,
)
from sampler_service.sampling import SamplingOptions, prompt_seed
from sampler_service.weights import WeightStore
from splitrl.config import MIN_TEMPERATURE, SamplingConfig, temperature_ok
from splitrl.error_cause import Cause
from splitrl.serving import make_channel
from splitrl.tokenizer import ByteLevelBytes, longest_token_chars
from splitrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc, sampler_pb2

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT
ENVIRONMENT_REWARD = "environment"  # the name of an environment's own reward
MAX_TEMPERATURE = 100.0


class RequestError(Exception):
    """A request cannot be served; ``code`` is the gRPC status to answer with, ``cause`` what the
    caller must know beside it (sent as trailing metadata, see ``splitrl.error_cause``)."""

    def __init__(self, code: grpc.StatusCode, message: str, cause: Cause | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.cause = cause


@dataclass
class PreparedPrompt:
    prompt_id: str
    token_ids: list[int]
    text: str  # what the reward functions see as the prompt
    reference: str
    metadata: dict[str, str] = field(default_factory=dict)
    seed: int = 0  # the noise of its completions (see sampling.row_keys)
    messages: list[dict[str, str]] | None = None  # sent as chat messages: for the rewards
    columns_json: str = ""  # the row's dataset columns, passed on to the rewards


class RewardClient:
    """``Reward.Score`` over one channel; a dead service becomes UNAVAILABLE with the address
    and the cause ``REWARD_UNAVAILABLE`` (the trainer pauses rather than blame the sampler)."""

    def __init__(self, address: str, timeout_s: float, connect_timeout_s: float = 5.0,
                 auth=None):
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        # Reward replicas behind one name share the load (the service is stateless).
        self._channel = make_channel(address, auth=auth, balanced=True)
        self._stub = reward_pb2_grpc.RewardStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def check_reachable(self) -> None:
        """Raise UNAVAILABLE unless the reward service answers its health check as serving.

        A blocking call: a request runs it on a scoring thread while its generation starts
        (a `future()` would start gRPC's channel polling thread for each request on an idle
        channel, at the start of the request)."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(),
                                       timeout=self.connect_timeout_s)
        except grpc.RpcError as e:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"reward service at {self.address} (services.reward_address) is unavailable"
                f" ({e.code().name}: {e.details()}); rollouts cannot be scored",
                Cause.REWARD_UNAVAILABLE) from None
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"reward service at {self.address} is unavailable: its health status is "
                f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
                Cause.REWARD_UNAVAILABLE)

    def score(self, items: list[reward_pb2.ScoreItem],
              functions: Sequence[str]) -> dict[str, reward_pb2.ItemScore]:
        start = time.perf_counter()
        try:
            reply = self._stub.Score(
                reward_pb2.ScoreRequest(items=items, functions=list(functions)),
                timeout=self.timeout_s)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED):  # busy: the trainer backs off
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"reward service at {self.address} is unavailable ({code.name}: "
                    f"{e.details()}); rollouts cannot be scored",
                    Cause.REWARD_UNAVAILABLE) from None
            raise RequestError(code, f"reward service at {self.address} refused the Score "
                               f"call: {code.name}: {e.details()}") from None
        finally:
            metrics.SCORE_SECONDS.observe(time.perf_counter() - start)
        scores = {s.item_id: s for s in reply.scores}
        missing = [i.item_id for i in items if i.item_id not in scores]
        if missing:
            raise RequestError(grpc.StatusCode.INTERNAL,
                               f"reward service at {self.address} returned no score for "
                               f"{len(missing)} of {len(items)} items, e.g. {missing[:3]}")
        return scores

    def close(self) -> None:
        self._channel.close()


class RolloutWorker:
    """Validation, prompt encoding, engine calls and scoring for the sampler servicer."""

    def __init__(self, engine, weights: WeightStore, *, tokenizer, sampling: SamplingConfig,
                 reward: RewardClient | None, sampler_id: str, episodes=None):
        self.engine = engine
        # sampler_service.episodes.Episodes when an environment is configured: a Rollout's
        # completions are then multi-turn episodes (docs/environments.md).
        self.episodes = episodes
        self.weights = weights
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.reward = reward
        self.sampler_id = sampler_id
        self.vocab_size = weights.config.vocab_size
        self.max_batch_size = engine.max_batch_size
        self.max_sequence_length = engine.max_sequence_length
        # Prompt text longer than this cannot encode to max_sequence_length tokens (twice the
        # bound, for normalizers that change the text's length): refused before tokenizing.
        self._longest_token = longest_token_chars(tokenizer) if tokenizer is not None else 1
        self._max_prompt_chars = 2 * self._longest_token * self.max_sequence_length
        self._scorer = ThreadPoolExecutor(max_workers=4, thread_name_prefix="score")
        self._raw_bytes = ByteLevelBytes(tokenizer) if tokenizer is not None else None

    # -- validation -----------------------------------------------------------------------------

    def sampling_options(self, params: common_pb2.SamplingParams,
                         where: str = "sampling") -> SamplingOptions:
        t = params.temperature
        if not math.isfinite(t) or not temperature_ok(t) or t > MAX_TEMPERATURE:
            raise RequestError(_INVALID, f"{where}.temperature: expected 0 (greedy) or "
                               f"{MIN_TEMPERATURE:g} <= temperature <= {MAX_TEMPERATURE:g} "
                               f"(smaller temperatures overflow float32 logits / temperature), "
                               f"got {t!r}")
        if params.top_k < 0:
            raise RequestError(_INVALID, f"{where}.top_k: expected >= 0 (0 = off), got "
                               f"{params.top_k}")
        p = params.top_p
        if not math.isfinite(p) or p < 0 or p > 1:
            raise RequestError(_INVALID, f"{where}.top_p: expected 0 < top_p <= 1 (0 or 1 = "
                               f"off), got {p!r}")
        new = params.max_new_tokens or self.sampling.max_new_tokens
        if new < 1 or new >= self.max_sequence_length:
            raise RequestError(_INVALID, f"{where}.max_new_tokens: expected 1 <= max_new_tokens "
                               f"< max_sequence_length {self.max_sequence_length}, got {new}")
        stops = list(params.stop_token_ids) or list(self.sampling.stop_token_ids)
        bad = [s for s in stops if not 0 <= s < self.vocab_size]
        if bad:
            raise RequestError(_INVALID, f"{where}.stop_token_ids: ids must be in [0, "
                               f"{self.vocab_size}), got {bad[:5]}")
        seed = int(params.seed) if params.has_seed else secrets.randbits(63)
        return SamplingOptions(
            temperature=float(t), top_k=min(int(params.top_k), self.vocab_size),
            top_p=float(p) if 0 < p < 1 else 1.0, max_new_tokens=int(new),
            stop_token_ids=tuple(stops), seed=seed, greedy=bool(params.greedy or t == 0))

    def group_size(self, value: int, where: str, *, zero_means_one: bool = False) -> int:
        if value == 0 and zero_means_one:
            return 1
        if not 1 <= value <= self.max_batch_size:
            raise RequestError(_INVALID, f"{where}: expected 1 <= {where} <= the sampler's "
                               f"max_batch_size {self.max_batch_size}, got {value}")
        return value

    def prepare(self, prompts: Sequence[common_pb2.Prompt], max_new_tokens: int,
                where: str = "prompts") -> list[PreparedPrompt]:
        if not prompts:
            raise RequestError(_INVALID, f"{where}: expected at least one prompt, got none")
        return [self._prepare_one(p, f"{where}[{i}]", str(i), max_new_tokens)
                for i, p in enumerate(prompts)]

    @staticmethod
    def assign_seeds(prompts: Sequence[common_pb2.Prompt], prepared: list[PreparedPrompt],
                     options: SamplingOptions) -> None:
        """Each prompt's seed: its own (``Prompt.seed``), else a hash of the request's seed and
        its index in the request, so a prompt's samples do not depend on how the request is
        split into engine batches."""
        for i, (message, prompt) in enumerate(zip(prompts, prepared, strict=True)):
            prompt.seed = int(message.seed) if message.has_seed else prompt_seed(options.seed, i)

    def _prepare_one(self, prompt: common_pb2.Prompt, where: str, default_id: str,
                     max_new_tokens: int) -> PreparedPrompt:
        kinds = [k for k, present in (("token_ids", bool(prompt.token_ids)),
                                      ("text", bool(prompt.text)),
                                      ("messages", bool(prompt.messages))) if present]
        if len(kinds) != 1:
            raise RequestError(_INVALID, f"{where}: set exactly one of token_ids, text or "
                               f"messages, got {kinds or 'none (empty prompt)'}")
        if kinds[0] == "token_ids":
            ids = list(prompt.token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(_INVALID, f"{where}.token_ids: ids must be in [0, "
                                   f"{self.vocab_size}) (the model's vocabulary), got {bad[:5]}")
            text = self._decode(ids, skip_special=False)[0] if self.tokenizer else ""
        else:
            if self.tokenizer is None:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{where}.{kinds[0]}: this sampler has no tokenizer (none in "
                                   "model.path); send token_ids")
            from splitrl.tokenizer import encode_rendered, render_prompt

            messages = None
            if kinds[0] == "messages":
                for j, m in enumerate(prompt.messages):
                    if not m.role:
                        raise RequestError(_INVALID, f"{where}.messages[{j}].role: expected a "
                                           "role (system, user, assistant), got ''")
                messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
            text_in = prompt.text or None
            chars = len(prompt.text) + sum(len(m.content) for m in prompt.messages)
            if chars > self._max_prompt_chars:
                raise RequestError(_INVALID, f"{where}.{kinds[0]}: {chars} characters cannot fit "
                                   f"the sampler's max_sequence_length {self.max_sequence_length}"
                                   " (refused before tokenizing: no token of this tokenizer "
                                   f"covers more than {self._longest_token} characters)")
            try:
                tools = self.episodes.tools if self.episodes is not None else None
                text = render_prompt(self.tokenizer, text_in, messages, tools=tools)
                ids = encode_rendered(self.tokenizer, text)  # rendered once, not twice
            except ValueError as e:
                raise RequestError(_INVALID, f"{where}: {e}") from None
            if not ids:
                raise RequestError(_INVALID, f"{where}.{kinds[0]}: encodes to no tokens")
        if prompt.columns_json:
            from splitrl.reward_protocol import decode_columns

            try:
                decode_columns(prompt.columns_json, f"{where}.columns_json")
            except ValueError as e:
                raise RequestError(_INVALID, str(e)) from None
        if len(ids) + max_new_tokens > self.max_sequence_length:
            raise RequestError(_INVALID, f"{where}: prompt of {len(ids)} tokens + max_new_tokens "
                               f"{max_new_tokens} exceeds the sampler's max_sequence_length "
                               f"{self.max_sequence_length}")
        return PreparedPrompt(prompt.prompt_id or default_id, ids, text, prompt.reference,
                              dict(prompt.metadata), messages=messages if kinds[0] == "messages"
                              else None, columns_json=prompt.columns_json)

    def check_min_version(self, min_version: int) -> None:
        version = self.weights.version
        if version < min_version:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"min_version is {min_version} but this sampler serves weight "
                               f"version {version}; push newer weights first")

    # -- generation -----------------------------------------------------------------------------

    def submit(self, prompts: list[PreparedPrompt], options: SamplingOptions, n: int, *,
               exclusive: bool = False, sink=None) -> GenerationRequest:
        try:
            return self.engine.submit([p.token_ids for p in prompts], options, n,
                                      seeds=[p.seed for p in prompts], exclusive=exclusive,
                                      sink=sink)
        except ValueError as e:  # the engine's own checks; ours should have caught it
            raise RequestError(_INVALID, str(e)) from None
        except EngineClosed as e:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"the sampler is stopping: {e}") \
                from None

    @staticmethod
    def _engine_error(error: BaseException) -> BaseException:
        if isinstance(error, EngineClosed):
            return RequestError(grpc.StatusCode.UNAVAILABLE, f"the sampler is stopping: {error}")
        return error

    @staticmethod
    def _record(group: FinishedGroup) -> None:
        metrics.QUEUE_SECONDS.observe(group.queue_s)
        metrics.GENERATE_SECONDS.observe(group.generate_s)
        metrics.TOKENS_GENERATED.inc(sum(len(s.token_ids) for s in group.sequences))
        metrics.SEQUENCES_GENERATED.inc(len(group.sequences))

    def _cut_at_stop_string(self, seq):
        """``seq`` ended at the first of ``sampling.stop_strings`` it wrote."""
        if self.tokenizer is None:
            return seq
        return cut_at_stop_string(seq, self.tokenizer, self.sampling.stop_strings)

    def completion(self, seq) -> common_pb2.Completion:
        seq = self._cut_at_stop_string(seq)
        text = self._decode(seq.token_ids)[0] if self.tokenizer else ""
        return common_pb2.Completion(token_ids=seq.token_ids, logprobs=seq.logprobs, text=text,
                                     finish_reason=seq.finish_reason,
                                     weight_versions=seq.weight_versions)

    def generate(self, request: sampler_pb2.GenerateRequest,
                 context=None) -> sampler_pb2.GenerateReply:
        """``context``: the RPC's; when it ends (e.g. the client cancels) generation stops."""
        options = self.sampling_options(request.sampling)
        n = self.group_size(request.n, "n", zero_means_one=True)
        prompts = self.prepare(request.prompts, options.max_new_tokens)
        self.assign_seeds(request.prompts, prompts, options)
        handle = self.submit(prompts, options, n)
        if context is not None:
            context.add_callback(handle.cancel)
        groups: dict[int, FinishedGroup] = {}
        try:
            for group in handle.groups():
                self._record(group)
                groups[group.index] = group
        except Exception as e:
            raise self._engine_error(e) from None
        finally:
            handle.cancel()
        if len(groups) != len(prompts):
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the sampler stopped before the "
                               "request finished")
        outputs = [sampler_pb2.GeneratedPrompt(
            prompt_id=p.prompt_id, prompt_token_ids=p.token_ids,
            completions=[self.completion(s) for s in groups[i].sequences])
            for i, p in enumerate(prompts)]
        version = min(s.weight_versions[0] for g in groups.values() for s in g.sequences)
        return sampler_pb2.GenerateReply(outputs=outputs, weight_version=version)

    # -- rollout --------------------------------------------------------------------------------

    def rollout(self, request: sampler_pb2.RolloutRequest,
                context=None) -> Iterator[sampler_pb2.ScoredGroup]:
        """Streams one scored group per prompt, in the order they finish (``context``: the
        RPC's; when it ends, e.g. the trainer cancels, the request's rows are freed).

        The whole request goes to the engine at once (its prompts join the shared batch as
        decode slots free up; ``reproducible`` runs it alone). Finished groups are scored in
        batches, one Score call in flight: groups that finish meanwhile wait for the next.
        """
        options = self.sampling_options(request.sampling)
        group = self.group_size(request.group_size, "group_size")
        prompts = self.prepare(request.prompts, options.max_new_tokens)
        self.assign_seeds(request.prompts, prompts, options)
        self.check_min_version(request.min_version)
        if self.reward is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this sampler has no reward service configured "
                               "(services.reward_address)")
        if self.tokenizer is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this sampler has no tokenizer (none in model.path); Rollout "
                               "needs one to decode completions for the reward service")
        events: queue.SimpleQueue = queue.SimpleQueue()
        if self.episodes is not None:
            handle = self._start_episodes(request, prompts, options, group, events)
        else:
            handle = self.submit(prompts, options, group, exclusive=request.reproducible,
                                 sink=events)
        # Asked while the request generates; a dead or not-serving reward service still fails
        # the request (UNAVAILABLE) and cancels its generation.
        reachable = self._scorer.submit(self.reward.check_reachable)
        if context is not None:
            context.add_callback(handle.cancel)
        try:
            reachable.result()
            yield from self._scored_as_finished(request, prompts, events)
        finally:
            handle.cancel()

    def _start_episodes(self, request, prompts: list[PreparedPrompt], options: SamplingOptions,
                        group: int, events: queue.SimpleQueue):
        """Start the environments of the request's episodes and run them (``prompts`` is
        updated in place when an environment's reset gives text for the prompt)."""
        from splitrl.reward_protocol import decode_columns

        keys = self.episodes.new_keys(len(prompts), group)
        columns = [decode_columns(p.columns_json) for p in prompts]
        texts, failed = self.episodes.reset(keys, columns)
        if any(texts):
            prompts[:] = self._with_reset_text(request.prompts, prompts, texts, options)
        return self.episodes.run([p.token_ids for p in prompts], [p.seed for p in prompts],
                                 keys, options, group, exclusive=request.reproducible,
                                 sink=events, failed=failed,
                                 stop_strings=self.sampling.stop_strings)

    def _with_reset_text(self, messages: Sequence[common_pb2.Prompt],
                         prompts: list[PreparedPrompt], texts: list[str],
                         options: SamplingOptions) -> list[PreparedPrompt]:
        """The prompts with each environment's reset text appended (to the text, or to the
        last chat message), prepared again (their seeds kept)."""
        out = []
        for i, (message, prompt, text) in enumerate(zip(messages, prompts, texts, strict=True)):
            if not text:
                out.append(prompt)
                continue
            changed = common_pb2.Prompt()
            changed.CopyFrom(message)
            if changed.messages:
                changed.messages[-1].content += "\n\n" + text
            elif changed.text:
                changed.text += "\n\n" + text
            else:
                raise RequestError(_INVALID, f"prompts[{i}]: the environment's reset returned "
                                   "text for a prompt sent as token ids; send text or messages")
            again = self._prepare_one(changed, f"prompts[{i}]", str(i), options.max_new_tokens)
            again.seed = prompt.seed
            out.append(again)
        return out

    def _scored_as_finished(self, request, prompts: list[PreparedPrompt],
                            events: queue.SimpleQueue) -> Iterator[sampler_pb2.ScoredGroup]:
        waiting: list[FinishedGroup] = []
        scoring, ended, remaining = False, False, len(prompts)
        while remaining:
            for event in _available(events):
                if isinstance(event, FinishedGroup):
                    self._record(event)
                    waiting.append(event)
                elif isinstance(event, Future):
                    scoring = False
                    scored = event.result()  # a RequestError from the reward service propagates
                    remaining -= len(scored)
                    yield from scored
                elif isinstance(event, BaseException):
                    raise self._engine_error(event)
                else:  # None: the engine is done with the request
                    ended = True
            if waiting and not scoring:
                future = self._scorer.submit(self._score_groups, request, prompts, waiting)
                future.add_done_callback(events.put)
                waiting, scoring = [], True
            if ended and remaining and not scoring:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the sampler stopped before "
                                   "the request finished")

    def _score_groups(self, request, prompts: list[PreparedPrompt],
                      finished: list[FinishedGroup]) -> list[sampler_pb2.ScoredGroup]:
        items = []
        completions = []
        for group in finished:
            prompt = prompts[group.index]
            done = []
            for j, seq in enumerate(group.sequences):
                completion, item = (self._episode_item(seq) if isinstance(seq, Trajectory)
                                    else self._completion_item(seq))
                item.MergeFrom(reward_pb2.ScoreItem(
                    item_id=f"{group.index}:{j}", prompt=prompt.text,
                    reference=prompt.reference, metadata=prompt.metadata,
                    # One call per function scores the prompt's group, with its columns.
                    group_id=str(group.index), columns_json=prompt.columns_json,
                    prompt_messages=prompt.messages or (),
                    weight_version=seq.weight_versions[0]))
                done.append(completion)
                items.append(item)
            completions.append(done)
        start = time.perf_counter()
        assert self.reward is not None  # rollout() refuses a request without one
        scores = self.reward.score(items, request.reward_functions)
        score_s = time.perf_counter() - start
        out = []
        for group, done in zip(finished, completions, strict=True):
            prompt = prompts[group.index]
            for j, completion in enumerate(done):
                s = scores[f"{group.index}:{j}"]
                completion.rewards.update(dict(s.scores))
                completion.total_reward = s.total
                completion.reward_reasons.update(dict(s.reasons))
                completion.reward_outcomes.update(dict(s.outcomes))
                reward = getattr(group.sequences[j], "env_reward", None)
                if reward is not None:  # the environment's own, weighted in
                    completion.rewards[ENVIRONMENT_REWARD] = reward
                    completion.total_reward += self.episodes.cfg.reward_weight * reward
            out.append(sampler_pb2.ScoredGroup(
                request_id=request.request_id, prompt_id=prompt.prompt_id,
                prompt_token_ids=prompt.token_ids, completions=done,
                weight_version=min(s.weight_versions[0] for s in group.sequences),
                sampler_id=self.sampler_id, reference=prompt.reference,
                metadata=prompt.metadata,
                timings=common_pb2.Timings(queue_s=group.queue_s, generate_s=group.generate_s,
                                           score_s=score_s)))
        return out

    def _completion_item(self, seq) -> tuple[common_pb2.Completion, reward_pb2.ScoreItem]:
        """A single-turn completion and what the reward functions get of it."""
        seq = self._cut_at_stop_string(seq)
        text, raw = self._decode(seq.token_ids)
        completion = common_pb2.Completion(
            token_ids=seq.token_ids, logprobs=seq.logprobs, text=text,
            finish_reason=seq.finish_reason, weight_versions=seq.weight_versions)
        item = reward_pb2.ScoreItem(
            completion=text, completion_tokens=len(seq.token_ids),
            truncated=seq.finish_reason == "length", completion_raw=raw or b"",
            completion_ids=seq.token_ids)
        return completion, item

    def _episode_item(self, seq: Trajectory) -> tuple[common_pb2.Completion,
                                                      reward_pb2.ScoreItem]:
        """An episode as a completion (all its ids, its loss mask, turns and conversation),
        and what the reward functions get: the final turn's text as ``completion``, the
        conversation as ``completion_messages``."""
        messages = [common_pb2.ChatMessage(role=m["role"], content=m["content"],
                                           name=m.get("name", ""),
                                           tool_calls_json=tool_calls_json(m))
                    for m in seq.messages]
        turns = [common_pb2.Turn(
            start=t.start, generated_tokens=t.generated, observation_tokens=t.observation,
            weight_versions=t.weight_versions,
            tool_calls=[common_pb2.ToolCallRecord(
                name=c["name"], arguments_json=json.dumps(c["arguments"]), status=c["status"],
                seconds=c["seconds"]) for c in t.tool_calls]) for t in seq.turns]
        completion = common_pb2.Completion(
            token_ids=seq.token_ids, logprobs=seq.logprobs, text=self._decode(seq.token_ids)[0],
            finish_reason=seq.finish_reason, weight_versions=seq.weight_versions,
            model_token_mask=seq.model_token_mask, turns=turns, messages=messages,
            episode_end=seq.episode_end)
        answer, raw = self._decode(seq.answer_ids)
        item = reward_pb2.ScoreItem(
            completion=answer, completion_raw=raw or b"",
            completion_tokens=sum(seq.model_token_mask), truncated=seq.truncated,
            completion_ids=seq.answer_ids, completion_messages=messages)
        return completion, item

    # -- text -----------------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int], skip_special: bool = True) -> tuple[str, bytes | None]:
        """(text, raw bytes if the completion is not valid UTF-8, else None)."""
        from splitrl.tokenizer import decode

        text = decode(self.tokenizer, ids, skip_special_tokens=skip_special)
        if "\ufffd" not in text:
            return text, None
        assert self._raw_bytes is not None  # set with the tokenizer that decoded the text
        raw = self._raw_bytes(ids, skip_special)
        if raw is None:
            return text, None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return text, raw
        return text, None

    def close(self) -> None:
        self._scorer.shutdown(wait=False, cancel_futures=True)
        if self.episodes is not None:
            self.episodes.close()
        if self.reward is not None:
            self.reward.close()


def _available(events: queue.SimpleQueue) -> list:
    """The next event (waiting for it) and every other one already queued: the groups a decode
    segment finishes arrive together, and are scored in one Score call rather than the first
    alone and the rest after it (one Score call less on the critical path of a step)."""
    out = [events.get()]
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out
