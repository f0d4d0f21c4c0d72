"""Multi-turn episodes: a completion as turns of the model and calls of an environment's tools.

    episodes = Episodes(cfg.environment, tokenizer, engine, max_sequence_length)
    texts = episodes.reset(keys, columns)               # start the environments (reset)
    handle = episodes.run(prompts, keys, options, n, exclusive=..., sink=events)
    # events receives a FinishedGroup of `Trajectory`s per prompt, then None (or an error)

How a turn runs (docs/environments.md, "Design"): the first turn of a prompt's n episodes is one
engine request (n rows, one prefill). When a row's turn ends it leaves the batch like any
finished completion; its text is parsed for tool calls (`splitrl.environments.parsing`), the
calls run in the environment's isolated workers (`ToolRunner`) on a thread pool, off the
engine's thread, and the results are rendered by the chat template to token ids
(`ObservationRenderer`) and appended. The trajectory then re-enters the engine as a new prompt
(prompt + generated ids + observation ids) for its next turn. Generated ids are kept as
generated; nothing is re-tokenized.

With ``exclusive`` (reproducible requests) the episodes advance in lock-step: the next turns are
submitted together, as exclusive engine requests, once every tool call of the previous turn has
returned, so what decodes together is a function of the request. Otherwise a trajectory
re-enters as soon as its own tools return. Turn t of episode j of a prompt samples from
`turn_seed` (prompt seed, j, t), whatever request carries it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sampler_service import metrics
from sampler_service.requests import FinishedGroup, cut_at_stop_string
from sampler_service.sampling import SamplingOptions
from splitrl.config import EnvironmentConfig
from splitrl.environments import (
    Started,
    ToolCall,
    ToolRunner,
    detect_format,
    parse_tool_calls,
)
from splitrl.environments.render import ObservationRenderer

log = logging.getLogger(__name__)

# Why an episode ended (Completion.episode_end). LIMITS are the truncations.
ANSWER, DONE, LENGTH = "answer", "done", "length"
LIMITS = ("max_turns", "max_tool_calls", "max_total_tokens", LENGTH)
RESET_FAILED = "reset_failed"


def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The noise seed of turn ``turn`` (>= 1; turn 0 is the prompt's own row ``sample``) of
    episode ``sample`` of a prompt seeded ``prompt_seed``."""
    seed = int(prompt_seed) % (1 << 64)
    words = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, int(sample), int(turn),
                                    0x7475726E])  # "turn": apart from prompt_seed's streams
    low, high = words.generate_state(2, np.uint32)
    return int(low) | (int(high) << 32)


@dataclass
class TurnRecord:
    start: int  # offset of its generated tokens in the trajectory
    generated: int
    observation: int = 0
    weight_versions: tuple[int, ...] = ()
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # name, arguments, status...


@dataclass(frozen=True)
class Trajectory:
    """One finished episode (what `GeneratedSequence` is for a single-turn completion)."""

    token_ids: list[int]  # generated and observation ids after the prompt
    logprobs: list[float]  # 0 on observation tokens
    finish_reason: str  # of its last turn: "stop" | "length"
    weight_versions: tuple[int, ...]  # of all its turns, oldest first
    model_token_mask: list[bool]
    turns: list[TurnRecord]
    messages: list[dict[str, Any]]  # the conversation after the prompt
    episode_end: str
    answer_ids: list[int]  # the last turn's generated ids: what the rewards read as the answer
    env_reward: float | None = None

    @property
    def truncated(self) -> bool:
        return self.episode_end in LIMITS


@dataclass
class _Episode:
    key: str
    prompt: int
    sample: int
    prompt_ids: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_calls: int = 0
    finish_reason: str = "stop"
    end: str = ""
    reward: float | None = None
    closed: bool = False  # its environment was ended (reward read)


class Episodes:
    """An environment's episodes on one sampler: the tool workers, the observation renderer
    and the limits (``cfg``). One instance serves every request; see the module docstring."""

    def __init__(self, cfg: EnvironmentConfig, tokenizer, engine, max_sequence_length: int,
                 *, stop_token_ids: Sequence[int] = ()):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_sequence_length = max_sequence_length
        self.format = (detect_format(tokenizer.chat_template) if cfg.tool_format == "auto"
                       else cfg.tool_format)
        self.runner = ToolRunner(cfg.name, cfg.options, workers=cfg.workers,
                                 timeout_s=cfg.tool_timeout_s, kill_grace_s=cfg.kill_grace_s,
                                 memory_mb=cfg.worker_memory_mb,
                                 max_observation_chars=cfg.max_observation_chars)
        self.tools = self.runner.schemas
        self.renderer = ObservationRenderer(tokenizer, self.tools, stop_token_ids)
        # Tool calls block on their worker; enough threads that every worker stays busy.
        self._pool = ThreadPoolExecutor(max_workers=max(4, 4 * cfg.workers),
                                        thread_name_prefix="tools")
        self._ids = itertools.count()

    def new_keys(self, prompts: int, n: int) -> list[list[str]]:
        """Unique episode ids, ``[prompt][sample]``."""
        base = next(self._ids)
        return [[f"{base}:{i}:{j}" for j in range(n)] for i in range(prompts)]

    def reset(self, keys: list[list[str]], columns: list[dict[str, Any]]
              ) -> tuple[list[str], set[str]]:
        """Start every episode (``reset(**columns)`` of its prompt's row, in the workers).
        Returns each prompt's text to append to it (its first episode's, since a prompt's
        episodes share its prefill) and the episodes whose reset failed: those run their first
        turn and end (``reset_failed``)."""
        # A batch per worker (one round trip each), dealt in turn: a prompt's episodes, whose
        # tool calls come together, live on different workers.
        flat = [(key, columns[i]) for i, row in enumerate(keys) for key in row]
        workers = max(self.runner.workers, 1)
        batches = [flat[w::workers] for w in range(min(workers, len(flat)))]
        started: dict[str, Started] = {}
        for batch, future in [(b, self._pool.submit(self.runner.start_many, b))
                              for b in batches]:
            started.update(zip((key for key, _ in batch), future.result(), strict=True))
        texts = [started[row[0]].text if started[row[0]].status == "ok" else ""
                 for row in keys]
        failed = {key for key, s in started.items() if s.status != "ok"}
        return texts, failed

    def run(self, prompts: list[list[int]], seeds: list[int], keys: list[list[str]],
            options: SamplingOptions, n: int, *, exclusive: bool, sink,
            failed: AbstractSet[str] = frozenset(), stop_strings: Sequence[str] = ()
            ) -> _Driver:
        """Run the episodes on their own thread. ``stop_strings`` (``sampling.stop_strings``)
        end a turn where its text first holds one, as they end a single-turn completion."""
        driver = _Driver(self, prompts, seeds, keys, options, n, exclusive, sink, failed,
                         tuple(stop_strings))
        threading.Thread(target=driver.run, name="episodes", daemon=True).start()
        return driver

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.runner.close()


class _Tagged:
    """A sink that tags what an engine request delivers with the request's tag."""

    def __init__(self, events: queue.SimpleQueue, tag: int):
        self.events, self.tag = events, tag

    def put(self, item) -> None:
        self.events.put(("engine", self.tag, item))


class _Driver:
    """One request's episodes, driven on their own thread (the engine and the tool pool feed
    its event queue; it alone changes the episodes)."""

    def __init__(self, owner: Episodes, prompts, seeds, keys, options, n, exclusive, sink,
                 failed, stop_strings):
        self.owner, self.cfg = owner, owner.cfg
        self.failed = failed
        self.stop_strings = stop_strings
        self.options, self.n, self.exclusive, self.sink = options, n, exclusive, sink
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.episodes = {key: _Episode(key, i, j, list(prompts[i]), seeds[i])
                         for i, row in enumerate(keys) for j, key in enumerate(row)}
        self.keys = keys
        self.open_per_prompt = [n] * len(prompts)
        self.started = [0.0] * len(prompts)
        self.queue_s = [0.0] * len(prompts)
        self.submitted_at = time.perf_counter()
        self.handles: dict[int, Any] = {}  # tag -> engine request
        self.members: dict[int, list[str]] = {}  # tag -> episode keys of a later-turn request
        self.pending = 0  # tool calls and batches of environment ends not answered yet
        self.ready: list[str] = []
        self.ending: list[str] = []  # episodes whose environments to end (`_flush_ends`)
        self._tags = itertools.count()
        self._options: dict[int, SamplingOptions] = {}  # by a turn's token budget
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()
        for handle in list(self.handles.values()):
            handle.cancel()
        self.events.put(("cancel", None, None))

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        try:
            self._submit_first()
            while any(self.open_per_prompt) and not self._cancelled.is_set():
                self._handle(*self.events.get())
                while True:  # everything already queued, then (maybe) the next turns
                    try:
                        self._handle(*self.events.get_nowait())
                    except queue.Empty:
                        break
                self._flush_ends()
                self._maybe_submit()
            self.sink.put(None)
        except BaseException as e:  # noqa: BLE001 - report anything to the request
            log.exception("episodes failed")
            self.sink.put(e)
        finally:
            for handle in self.handles.values():
                handle.cancel()
            open_keys = [e.key for e in self.episodes.values() if not e.closed]
            if open_keys:  # cancelled or failed: free their environments
                try:
                    self.owner.runner.end_many(open_keys)
                except Exception:  # noqa: BLE001 - freeing must not hide the cause
                    log.exception("could not end the episodes' environments")

    def _handle(self, kind: str, tag, item) -> None:
        if kind == "engine":
            if isinstance(item, FinishedGroup):
                self._turn_finished(tag, item)
            elif isinstance(item, BaseException):
                raise item
            elif item is None:
                self.handles.pop(tag, None)
        elif kind == "tools":
            self.pending -= 1
            self._tools_returned(tag, item)
        elif kind == "ended":  # tag: the episodes' keys, item: their rewards (None: failed)
            self.pending -= 1
            for key, reward in zip(tag, item or [None] * len(tag), strict=True):
                self.episodes[key].reward, self.episodes[key].closed = reward, True
            for prompt in sorted({self.episodes[key].prompt for key in tag}):
                self._maybe_deliver(prompt)

    def _submit(self, prompts: list[list[int]], seeds: list[int], n: int, max_new: int,
                members: list[str] | None) -> None:
        tag = next(self._tags)
        options = self._options.get(max_new)
        if options is None:
            options = self._options[max_new] = dataclasses.replace(self.options,
                                                                   max_new_tokens=max_new)
        self.handles[tag] = self.owner.engine.submit(prompts, options, n, seeds=seeds,
                                                     exclusive=self.exclusive,
                                                     sink=_Tagged(self.events, tag))
        if members is not None:
            self.members[tag] = members

    def _submit_first(self) -> None:
        prompts = [self.episodes[row[0]].prompt_ids for row in self.keys]
        seeds = [self.episodes[row[0]].seed for row in self.keys]
        self._submit(prompts, seeds, self.n, self._budget(max(len(p) for p in prompts), 0),
                     None)

    def _budget(self, prompt_len: int, used: int) -> int:
        """Tokens the next turn may generate: the per-turn budget, within the episode's total
        and the sampler's sequence length."""
        total = self.cfg.max_total_tokens or self.owner.max_sequence_length
        room = min(total - used, self.owner.max_sequence_length - prompt_len - used)
        return max(0, min(self.options.max_new_tokens, room))

    # ------------------------------------------------------------------ a turn ends

    def _turn_finished(self, tag: int, group: FinishedGroup) -> None:
        members = self.members.get(tag)
        if members is None:  # the first turn: group.index is the prompt, rows its episodes
            keys = self.keys[group.index]
            self.started[group.index] = time.perf_counter() - group.generate_s
            self.queue_s[group.index] = group.queue_s
        else:
            keys = [members[group.index]]
        for key, seq in zip(keys, group.sequences, strict=True):
            self._after_turn(self.episodes[key], seq)

    def _after_turn(self, ep: _Episode, seq) -> None:
        seq = cut_at_stop_string(seq, self.owner.tokenizer, self.stop_strings)
        start = len(ep.ids)
        ep.ids += seq.token_ids
        ep.logprobs += seq.logprobs
        ep.mask += [True] * len(seq.token_ids)
        ep.versions += [v for v in seq.weight_versions if v not in ep.versions]
        ep.finish_reason = seq.finish_reason
        turn = TurnRecord(start, len(seq.token_ids), weight_versions=tuple(seq.weight_versions))
        ep.turns.append(turn)
        text = self._text(seq.token_ids)
        calls = parse_tool_calls(text, self.owner.format) if seq.finish_reason == "stop" else []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
        ep.messages.append(message)
        if ep.key in self.failed:
            return self._end(ep, RESET_FAILED)
        if seq.finish_reason != "stop":  # the turn's budget ran out: its own, or the episode's
            return self._end(ep, LENGTH if self._budget(len(ep.prompt_ids), len(ep.ids))
                             else "max_total_tokens")
        if not calls:
            return self._end(ep, ANSWER)
        if len(ep.turns) >= self.cfg.max_turns:
            return self._end(ep, "max_turns")
        if ep.tool_calls + len(calls) > self.cfg.max_tool_calls:
            return self._end(ep, "max_tool_calls")
        ep.tool_calls += len(calls)
        self.pending += 1
        future = self.owner._pool.submit(self._call_tools, ep.key, calls)  # noqa: SLF001
        future.add_done_callback(lambda f: self.events.put(
            ("tools", ep.key, f.exception() or f.result())))

    def _text(self, ids: Sequence[int]) -> str:
        return self.owner.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _call_tools(self, key: str, calls: list[ToolCall]) -> list[tuple[ToolCall, Any]]:
        """Run one turn's calls in order (a malformed one is answered without running)."""
        from splitrl.environments import CallResult

        out = []
        for call in calls:
            if call.error:
                out.append((call, CallResult("malformed", f"malformed tool call: {call.error}")))
            else:
                out.append((call, self.owner.runner.call(key, call)))
        return out

    def _tools_returned(self, key: str, results) -> None:
        ep = self.episodes[key]
        if isinstance(results, BaseException):
            raise results
        turn = ep.turns[-1]
        rendered = []
        done = False
        for call, result in results:
            name = call.name or (self.owner.runner.tool_names[0]
                                 if len(self.owner.runner.tool_names) == 1 else "")
            content = result.text if result.status == "ok" else f"error: {result.text}"
            turn.tool_calls.append({"name": name, "arguments": call.arguments,
                                    "status": result.status, "seconds": result.seconds})
            metrics.TOOL_CALLS.labels(tool=name, status=result.status).inc()
            metrics.TOOL_SECONDS.observe(result.seconds)
            ep.messages.append({"role": "tool", "name": name, "content": content})
            rendered.append((name, content))
            done = done or result.done
        if done:
            return self._end(ep, DONE)
        obs = self.owner.renderer.ids(rendered, stopped=True)
        if self._budget(len(ep.prompt_ids), len(ep.ids) + len(obs)) < 1:
            return self._end(ep, "max_total_tokens")
        turn.observation = len(obs)
        metrics.OBSERVATION_TOKENS.inc(len(obs))
        ep.ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [False] * len(obs)
        self.ready.append(key)

    def _maybe_submit(self) -> None:
        """Send the trajectories ready for their next turn (lock-step when exclusive: only once
        no tool call and no turn of the request is outstanding)."""
        if not self.ready or self._cancelled.is_set():
            return
        if self.exclusive and (self.pending or self.handles):
            return
        ready = sorted(self.ready, key=lambda k: (self.episodes[k].prompt,
                                                  self.episodes[k].sample))
        self.ready = []
        by_budget: dict[int, list[str]] = {}
        for key in ready:
            ep = self.episodes[key]
            by_budget.setdefault(self._budget(len(ep.prompt_ids), len(ep.ids)), []).append(key)
        for budget, keys in sorted(by_budget.items()):
            eps = [self.episodes[k] for k in keys]
            self._submit([ep.prompt_ids + ep.ids for ep in eps],
                         [turn_seed(ep.seed, ep.sample, len(ep.turns)) for ep in eps], 1,
                         budget, keys)

    # ------------------------------------------------------------------ an episode ends

    def _end(self, ep: _Episode, why: str) -> None:
        ep.end = why
        metrics.EPISODE_TURNS.observe(len(ep.turns))
        self.ending.append(ep.key)

    def _flush_ends(self) -> None:
        """End the environments of the episodes that ended since the last call: a batch per
        worker they live on (one round trip each, `ToolRunner.end_many`), off this thread."""
        if not self.ending:
            return
        runner = self.owner.runner
        for keys in runner.by_worker(self.ending):
            self.pending += 1
            future = self.owner._pool.submit(runner.end_many, keys)  # noqa: SLF001
            future.add_done_callback(functools.partial(self._ended, tuple(keys)))
        self.ending = []

    def _ended(self, keys: tuple[str, ...], future: Future) -> None:
        """A batch of ends came back (on the pool's thread): the driver's loop takes it."""
        self.events.put(("ended", keys, None if future.exception() else future.result()))

    def _maybe_deliver(self, prompt: int) -> None:
        eps = [self.episodes[k] for k in self.keys[prompt]]
        if not all(ep.closed for ep in eps):
            return
        mask_all = self.cfg.truncation == "mask"
        trajectories: list[Trajectory] = []
        for ep in eps:
            last = ep.turns[-1]
            truncated = ep.end in LIMITS
            trajectories.append(Trajectory(
                token_ids=ep.ids, logprobs=ep.logprobs, finish_reason=ep.finish_reason,
                weight_versions=tuple(sorted(ep.versions)),
                model_token_mask=[False] * len(ep.mask) if mask_all and truncated else ep.mask,
                turns=ep.turns, messages=ep.messages, episode_end=ep.end,
                answer_ids=ep.ids[last.start:last.start + last.generated],
                env_reward=ep.reward))
        self.open_per_prompt[prompt] = 0
        self.sink.put(FinishedGroup(index=prompt, sequences=trajectories,
                                    queue_s=self.queue_s[prompt],
                                    generate_s=time.perf_counter() - self.started[prompt]))


def tool_calls_json(message: dict[str, Any]) -> str:
    """An assistant message's tool calls as ChatMessage.tool_calls_json ("" for none)."""
    calls = message.get("tool_calls")
    return json.dumps(calls) if calls else ""
