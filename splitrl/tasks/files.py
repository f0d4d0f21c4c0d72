"""Any dataset with a prompt column and an answer column: local files or a hub name.

The prompt column holds text, or chat messages (a list of {role, content}). The reference is
the answer column as a string, or its final answer after `####` with `reference_format="gsm8k"`.
Prompt ids are `<id_prefix>-<split>-<row index>`, or `<id_prefix>-<value>` of `id_field`.
Every other column (the answer column too) reaches the reward functions under its own name, as
TRL passes a dataset's columns; a column named like a reserved keyword of the reward functions
(`completions`, `trainer_state`...) is refused when the split is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

from splitrl.reward_protocol import check_column_names
from splitrl.tasks.base import LazyRows, Row, Task, load_split, make_row, register_task
from splitrl.tasks.math_data import MATH_REWARDS, parse_gsm8k_answer

REFERENCE_FORMATS = ("raw", "gsm8k")


@register_task("files")
class FilesTask(Task):
    """Any dataset: local json/jsonl/parquet/csv files (a file, or a folder of <split> files)
    or a hub dataset name; prompt_field and answer_field name its columns. Columns: every other
    column of the data."""

    reward_functions = MATH_REWARDS

    def __init__(self, path: str | os.PathLike | None = None, prompt_field: str = "question",
                 answer_field: str = "answer", splits: tuple[str, ...] | list[str] | None = None,
                 subset: str | None = None, id_prefix: str | None = None,
                 id_field: str | None = None, reference_format: str = "raw"):
        if path is None:
            raise ValueError("task 'files' needs a path (data.path): a json/jsonl/parquet file, "
                             "a directory of <split>.<ext> files, or a hub dataset name")
        if reference_format not in REFERENCE_FORMATS:
            raise ValueError(f"reference_format: expected one of {list(REFERENCE_FORMATS)}, "
                             f"got {reference_format!r}")
        self.path = str(path)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self._splits = tuple(splits) if splits is not None else None
        self.subset = subset
        self.id_prefix = id_prefix or Path(self.path.replace("{split}", "")).stem or "data"
        self.id_field = id_field
        self.reference_format = reference_format

    @property
    def splits(self) -> tuple[str, ...]:
        """`splits` if given; one split, "train", for a single file; else train and test."""
        if self._splits is not None:
            return self._splits
        if "{split}" not in self.path and Path(self.path).is_file():
            return ("train",)
        return ("train", "test")

    def rows(self, split: str) -> LazyRows:
        self._check_split(split)
        dataset = load_split(self.path, split, subset=self.subset)
        columns = set(dataset.column_names)
        for key, field in (("prompt_field", self.prompt_field),
                           ("answer_field", self.answer_field), ("id_field", self.id_field)):
            if field is not None and field not in columns:
                raise ValueError(f"{key}={field!r} is not a column of {self.path} [{split}] "
                                 f"(columns: {sorted(columns)})")
        check_column_names(self._column_names(columns), f"{self.path} [{split}] column")
        return LazyRows(dataset, lambda i, rec: self._row(split, i, rec))

    def _column_names(self, columns) -> list[str]:
        """The columns passed to the reward functions: all but the prompt's (and the answer's
        when it is called `reference`: the reference is passed under that name already)."""
        skip = {self.prompt_field} | ({self.answer_field} if self.answer_field == "reference"
                                      else set())
        return [c for c in columns if c not in skip]

    def _row(self, split: str, index: int, record: dict) -> Row:
        if self.id_field is not None:
            prompt_id = f"{self.id_prefix}-{record[self.id_field]}"
        else:
            prompt_id = f"{self.id_prefix}-{split}-{index}"
        answer = record[self.answer_field]
        reference = "" if answer is None else str(answer)
        if self.reference_format == "gsm8k":
            reference = parse_gsm8k_answer(reference)
        meta = {k: record[k] for k in self._column_names(record)}
        prompt = record[self.prompt_field]
        if isinstance(prompt, str):
            return make_row(prompt_id, reference, meta, prompt=prompt)
        if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
            return make_row(prompt_id, reference, meta, messages=messages)
        raise ValueError(f"{prompt_id}: {self.prompt_field} must be text or a list of "
                         f"{{role, content}} messages, got {type(prompt).__name__}")
