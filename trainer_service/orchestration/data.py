"""The trainer's prompts: a task's rows, reshuffled every epoch, served by a checkpointed cursor.

    stream = PromptStream.from_config(config.trainer.data)
    batch = stream.next_batch(16)        # rows: prompt_id, prompt | messages, reference, ...
    state = stream.state_dict()          # JSON-able; saved with the checkpoint
    stream.load_state_dict(state)        # a resumed trainer gets exactly the same next batch

Every source goes through `splitrl.tasks`: built-in tasks (`arithmetic`, `gsm8k`, `math500`)
and `files` (local json/jsonl/parquet files or a hub dataset, loaded with `datasets`, with
`prompt_field`/`answer_field` mapping). Epoch `e` visits the rows in the order of a permutation
seeded by `(shuffle_seed, e)`, so the order is a pure function of the cursor and nothing but
`{epoch, index}` needs saving. A batch may span an epoch boundary; within an epoch no prompt is
served twice. `epochs=None` streams forever.

Served rows carry the epoch they belong to; `(prompt_id, epoch)` identifies one use of a
prompt, which is what a run counts to show every prompt was trained on exactly once.

Given a tokenizer and a token limit (`PromptStream.for_run`: `data.max_prompt_tokens`, by
default `sampler.max_sequence_length - sampling.max_new_tokens`), every row is measured at load
as the sampler will encode it, and the rows too long for a sampler are dropped, truncated or
refused (`data.long_prompt_policy`, see `prompt_length.py`) before any is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from splitrl.config import Config, DataConfig
from splitrl.tasks import Row, Task, get_task
from splitrl.tokenizer import build_messages, render_prompt
from trainer_service.orchestration.prompt_length import LengthReport, fit_split, token_counter

STATE_VERSION = 1


def build_task(config: DataConfig) -> Task:
    """The task named by `config.task`, with `config.path` and `config.options` as options
    (`files` also gets `prompt_field` and `answer_field`)."""
    options: dict[str, Any] = dict(config.options)
    if config.task == "files":
        options.setdefault("prompt_field", config.prompt_field)
        options.setdefault("answer_field", config.answer_field)
    if config.path is not None:
        options["path"] = config.path
    try:
        return get_task(config.task, **options)
    except ValueError as e:
        raise ValueError(f"data: {e}") from None


def format_row(row: Row, *, system_prompt: str | None = None,
               chat_template: bool = False) -> Row:
    """A task row as it is sent to a sampler.

    With `chat_template` (or when the row already holds messages) the prompt becomes chat
    `messages` (the system prompt first), which the sampler renders with the model's chat
    template and hands to the reward functions as messages (TRL's conversational format).
    Otherwise the prompt is plain text, prefixed by the system prompt and a blank line.
    `columns` (the dataset's other columns) go along for the reward functions.
    """
    out = {k: row[k] for k in ("prompt_id", "reference")}
    out["columns"] = dict(row.get("columns") or {})
    messages = row.get("messages")
    if messages is not None or chat_template:
        out["prompt"] = None
        out["messages"] = build_messages(row.get("prompt"), messages, system_prompt)
    else:
        out["prompt"] = render_prompt(None, row["prompt"], system_prompt=system_prompt)
        out["messages"] = None
    return out


def check_encodable(splits: dict[str, Sequence[Row]], tokenizer, config: DataConfig) -> None:
    """Refuse data the tokenizer cannot encode: a prompt whose characters the model would never
    see (the demo's character vocabulary turns "Tom has 3 apples and gets 3 more" into "33")
    trains on something other than the data, silently. ValueError naming the characters, how
    many prompts they change and one example as the model would see it."""
    from splitrl.tokenizer import lost_characters

    texts, owners = [], []
    for name, rows in splits.items():
        for row in rows:
            parts = ([row["prompt"]] if row.get("messages") is None
                     else [m["content"] for m in row["messages"]])
            texts += parts
            owners += [(name, row["prompt_id"])] * len(parts)
    extra = [config.system_prompt] if config.system_prompt else []
    if rows_in := [r for rows in splits.values() for r in rows[:1]]:  # the template's own text
        served = format_row(rows_in[0], system_prompt=config.system_prompt,
                            chat_template=config.chat_template)
        if served["messages"] is not None:
            extra.append(render_prompt(tokenizer, None, served["messages"]))
    texts += extra
    owners += [("template", "system prompt / chat template")] * len(extra)
    lost = lost_characters(tokenizer, texts)
    changed = [i for i, missing in enumerate(lost) if missing]
    if not changed:
        return
    chars = "".join(sorted(set().union(*(lost[i] for i in changed))))
    first = changed[0]
    seen = tokenizer.decode(tokenizer(texts[first], add_special_tokens=False)["input_ids"],
                            skip_special_tokens=False)
    total = sum(len(r) for r in splits.values())
    prompts = (total if any(owners[i][0] == "template" for i in changed)
               else len({owners[i] for i in changed}))
    raise ValueError(
        f"data: the model's tokenizer cannot encode {len(chars)} distinct character(s) of the "
        f"prompts and drops them: {chars!r}; {prompts} of {total} prompts would reach the "
        f"model changed, e.g. "
        f"{owners[first][1]} ({owners[first][0]}): {texts[first][:80]!r} is seen as "
        f"{seen[:80]!r}. Use a model whose tokenizer covers the data (`splitrl init-model DIR "
        f"--vocab default` writes one with a byte-level BPE that encodes any text) or change "
        f"the data")


class PromptStream:
    """Seeded, epoch-shuffled prompt batches with a resumable cursor, plus evaluation rows."""

    def __init__(self, rows: Sequence[Row], *, eval_rows: Sequence[Row] | None = None,
                 seed: int = 0, epochs: int | None = None, shuffle: bool = True,
                 system_prompt: str | None = None, chat_template: bool = False,
                 eval_size: int | None = None, task: Task | None = None,
                 length_reports: dict[str, LengthReport] | None = None):
        if len(rows) == 0:
            raise ValueError("data: the training split has no rows")
        if seed < 0:
            raise ValueError(f"data.shuffle_seed: expected a value >= 0, got {seed}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"data.epochs: expected None (forever) or >= 1, got {epochs}")
        self.rows = rows
        self._eval = eval_rows
        self.seed = seed
        self.epochs = epochs
        self.shuffle = shuffle
        self.system_prompt = system_prompt
        self.chat_template = chat_template
        self.eval_size = eval_size
        self.task = task
        # What the prompt length check found per split ("train", "eval"), when it ran.
        self.length_reports = dict(length_reports or {})
        self._epoch = 0
        self._index = 0
        self._served = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def for_run(cls, cfg: Config, *, tokenizer) -> PromptStream:
        """The run's prompts (`cfg.trainer.data`), with the rows too long for the samplers
        handled by `data.long_prompt_policy` against `cfg.prompt_token_limit()`."""
        return cls.from_config(cfg.trainer.data, tokenizer=tokenizer,
                               max_prompt_tokens=cfg.prompt_token_limit())

    @classmethod
    def from_config(cls, config: DataConfig, *, tokenizer=None,
                    max_prompt_tokens: int | None = None) -> PromptStream:
        """Loads `config.split` (and `config.eval_split`, if set) of the configured task; with
        a tokenizer and `max_prompt_tokens`, fits every row in that many tokens."""
        task = build_task(config)
        for key, split in (("split", config.split), ("eval_split", config.eval_split)):
            if split is not None and split not in task.splits:
                raise ValueError(f"data.{key}: task {config.task!r} has no split {split!r} "
                                 f"(splits: {list(task.splits)}; eval_split may be null)")
        splits = {"train": task.rows(config.split)}
        if config.eval_split is not None:
            splits["eval"] = task.rows(config.eval_split)
        if tokenizer is not None:
            check_encodable(splits, tokenizer, config)
        reports = {}
        if tokenizer is not None and max_prompt_tokens is not None:
            count = token_counter(tokenizer, lambda row: format_row(
                row, system_prompt=config.system_prompt, chat_template=config.chat_template))
            for name, rows in list(splits.items()):
                split = config.split if name == "train" else config.eval_split
                assert split is not None  # "eval" is loaded only when eval_split is set
                splits[name], reports[name] = fit_split(
                    rows, split=split, limit=max_prompt_tokens,
                    policy=config.long_prompt_policy, count=count, tokenizer=tokenizer)
        return cls(splits["train"], eval_rows=splits.get("eval"), seed=config.shuffle_seed,
                   epochs=config.epochs, system_prompt=config.system_prompt,
                   chat_template=config.chat_template, eval_size=config.eval_size,
                   task=task, length_reports=reports)

    def length_metrics(self) -> dict[str, float]:
        """Rows the prompt length check dropped or truncated (0 when it did not run)."""
        reports = self.length_reports.values()
        return {"data/long_prompts_dropped": float(sum(len(r.dropped) for r in reports)),
                "data/long_prompts_truncated": float(sum(len(r.truncated) for r in reports))}

    # -- cursor -------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def index(self) -> int:
        return self._index

    @property
    def served(self) -> int:
        """Rows served since the start of the run (over all epochs)."""
        return self._served

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self._epoch >= self.epochs

    def order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch `epoch` serves them."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        else:
            order = np.arange(self.size)
        self._order_cache = (epoch, order)
        return order

    def next_batch(self, n: int) -> list[Row]:
        """The next `n` rows (fewer, possibly none, once the last epoch is used up)."""
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        batch: list[Row] = []
        while len(batch) < n and not self.exhausted:
            row = self.rows[int(self.order(self._epoch)[self._index])]
            served = self._format(row)
            served["epoch"] = self._epoch
            batch.append(served)
            self._index += 1
            self._served += 1
            if self._index == self.size:
                self._epoch, self._index = self._epoch + 1, 0
        return batch

    def peek(self, n: int) -> list[Row]:
        """The rows `next_batch(n)` would return now, without serving them (the cursor stays)."""
        cursor = self._epoch, self._index, self._served
        try:
            return self.next_batch(n)
        finally:
            self._epoch, self._index, self._served = cursor

    def state_dict(self) -> dict[str, Any]:
        """The cursor, JSON-able: {version, epoch, index, served, seed, size, shuffle}."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "index": self._index,
                "served": self._served, "seed": self.seed, "size": self.size,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a cursor saved by `state_dict` for the same data and seed (else ValueError
        naming what differs). `epochs` comes from the current config, so a run can be extended.
        """
        missing = {"epoch", "index", "seed", "size"} - set(state)
        if missing:
            raise ValueError(f"data cursor: missing keys {sorted(missing)} in {state!r}")
        for key, current in (("size", self.size), ("seed", self.seed),
                             ("shuffle", self.shuffle)):
            if key in state and state[key] != current:
                raise ValueError(f"data cursor: saved with {key}={state[key]!r} but the data now "
                                 f"has {key}={current!r}; the saved position would point at "
                                 "other prompts")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.size:
            raise ValueError(f"data cursor: epoch={epoch}, index={index} out of range for "
                             f"{self.size} rows")
        self._epoch, self._index = epoch, index
        self._served = int(state.get("served", epoch * self.size + index))

    # -- evaluation ---------------------------------------------------------------------------

    @property
    def eval_split_rows(self) -> Sequence[Row]:
        """The evaluation split as loaded (after the length check, when one ran), unformatted;
        empty without one."""
        return self._eval or []

    def eval_rows(self, limit: int | None = None) -> list[Row]:
        """The first `limit` (default `eval_size`, else all) rows of the evaluation split, in
        the split's own order."""
        if self._eval is None:
            raise ValueError("data.eval_split is not set: no evaluation rows")
        limit = self.eval_size if limit is None else limit
        n = len(self._eval) if limit is None else min(limit, len(self._eval))
        return [self._format(self._eval[i]) for i in range(n)]

    def _format(self, row: Row) -> Row:
        return format_row(row, system_prompt=self.system_prompt,
                          chat_template=self.chat_template)
