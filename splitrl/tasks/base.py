"""The task interface, the registry, and loading a split of a local or hub dataset.

A task turns a dataset split into prompt rows::

    {"prompt_id": "gsm8k-train-12",          # stable across runs: counts and resumes rely on it
     "prompt": "Natalia sold clips ...",     # plain text, or None when the row has messages
     "messages": None,                       # or [{"role": "user", "content": ...}, ...]
     "reference": "72",                      # what the reward functions compare against
     "columns": {"answer": "Natalia ..."}}   # the dataset's other columns, with their types

`columns` reach every reward function as keyword arguments (one value per completion), the
way TRL passes a dataset's columns; they travel as JSON, so a value keeps its JSON type.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from splitrl.model_path import looks_like_hub_id
from splitrl.registry import Registry
from splitrl.reward_protocol import jsonable

Row = dict[str, Any]

_REGISTRY: Registry[type[Task]] = Registry("task")
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class Task:
    """A source of prompt rows per split plus the reward set it is meant to be scored with.

    `reward_functions` is the recommended `reward.functions` config (dicts of
    RewardFunctionConfig fields) and `sampling` the recommended `sampling` overrides.
    """

    name: str = ""
    reward_functions: tuple[dict[str, Any], ...] = ()
    sampling: dict[str, Any] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        raise NotImplementedError

    def rows(self, split: str) -> Sequence[Row]:
        """The rows of `split` in a fixed order (indexable; may be loaded lazily)."""
        raise NotImplementedError

    def corpus(self) -> Iterator[str]:
        """Text to train a tokenizer on (prompts and references of every split)."""
        for split in self.splits:
            for row in self.rows(split):
                yield row["prompt"] if row.get("prompt") is not None else "\n".join(
                    m["content"] for m in row["messages"])
                yield row["reference"]

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(f"task {self.name!r} has no split {split!r} "
                             f"(splits: {list(self.splits)})")


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator adding a task to the registry under `name`."""

    def deco(cls: type[Task]) -> type[Task]:
        cls.name = name
        return _REGISTRY.register(name)(cls)

    return deco


def list_tasks() -> list[str]:
    return sorted(_REGISTRY)


def describe_task(name: str) -> dict[str, Any]:
    """What `splitrl list tasks` shows: description, options with defaults, splits (those of
    the default instance; "" when they depend on the path) and recommended reward functions."""
    cls = _REGISTRY.get(name)
    params = inspect.signature(cls.__init__).parameters.values()
    options = {p.name: (None if p.default is p.empty else p.default) for p in params
               if p.name != "self"}
    try:
        splits = list(cls().splits)
    except (ValueError, TypeError):
        splits = []
    return {"name": name, "description": " ".join((inspect.getdoc(cls) or "").split()),
            "options": options, "splits": splits,
            "reward_functions": [f["name"] for f in cls.reward_functions]}


def get_task(name: str, **options: Any) -> Task:
    """The task `name` built with `options`; an unknown task or option is a ValueError naming
    it and listing what exists."""
    cls = _REGISTRY.get(name)
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"task {name!r} has no option {unknown[0]!r} (options: {params})")
    return cls(**options)


class LazyRows(Sequence[Row]):
    """Rows made on access from a `datasets.Dataset` (or any sequence) by `make(index, record)`."""

    def __init__(self, records: Sequence[Any], make: Callable[[int, Any], Row]):
        self._records = records
        self._make = make

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range (size {len(self)})")
        return self._make(index, self._records[int(index)])


DATA_DIR_ENV = "SPLITRL_DATA_DIR"


def default_data_dir() -> Path | None:
    """A folder of local dataset copies (`gsm8k/`, `math500/`) that the named tasks read
    instead of the hub: ``$SPLITRL_DATA_DIR``, or None (then they load the hub datasets)."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else None


def load_split(path: str | os.PathLike, split: str, *, subset: str | None = None):
    """One split as a `datasets.Dataset`.

    `path` is a json/jsonl/parquet/csv file (may contain `{split}`), a directory holding
    `<split>.<ext>` (or `<split>-*.<ext>` shards, also under `data/`), or a hub dataset name
    (`subset` is its config name; needs network unless cached). Turns off `datasets`'
    progress bars (they would garble the services' console).
    """
    import datasets

    datasets.disable_progress_bars()

    text = str(path).replace("{split}", split)
    local = Path(text)
    if local.is_dir():
        files = _split_files(local, split)
        if not files:
            raise FileNotFoundError(f"no file for split {split!r} in {local} "
                                    f"(looked for {split}.jsonl/.json/.parquet/.csv)")
    elif local.is_file():
        files = [local]
    elif _looks_like_hub_name(text):
        return datasets.load_dataset(text, subset, split=split)
    else:
        raise FileNotFoundError(f"dataset path {text!r} is neither a local file/directory nor a "
                                "hub name")
    formats = {_FILE_FORMATS.get(f.suffix) for f in files}
    if None in formats or len(formats) != 1:
        raise ValueError(f"cannot load {[str(f) for f in files]}: expected files of one format "
                         f"among {sorted(_FILE_FORMATS)}")
    return datasets.load_dataset(formats.pop(), data_files=[str(f) for f in files],
                                 split="train")


def _split_files(directory: Path, split: str) -> list[Path]:
    for base in (directory, directory / "data"):
        for ext in _FILE_FORMATS:
            exact = base / f"{split}{ext}"
            if exact.is_file():
                return [exact]
            shards = sorted(base.glob(f"{split}-*{ext}"))
            if shards:
                return shards
    return []


def _looks_like_hub_name(text: str) -> bool:
    """A hub id's shape (as for models), and not the name of a data file."""
    return looks_like_hub_id(text) and Path(text).suffix not in _FILE_FORMATS


def make_row(prompt_id: str, reference: str, columns: dict[str, Any], *,
             prompt: str | None = None, messages: list[dict[str, str]] | None = None) -> Row:
    if (prompt is None) == (messages is None):
        raise ValueError(f"row {prompt_id}: expected exactly one of prompt and messages")
    # JSON-safe from the start: rows travel as JSON (to the samplers, and in checkpoints with
    # the prompts not yet trained on), so a date or a numpy value becomes a string or a number.
    return {"prompt_id": prompt_id, "prompt": prompt, "messages": messages,
            "reference": reference, "columns": jsonable(dict(columns))}
