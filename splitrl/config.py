"""One typed config for every service.

A run is described by one YAML file; each service reads its own section. Dotted overrides on the
command line (``trainer.steps=50``) are applied on top. Loading is strict (pydantic v2, see
``splitrl/config_base.py``), because a typo in a key must fail fast with the key's name instead of
silently training with a default:

- an unknown key raises ``ConfigError("unknown key 'trainer.stpes' (known: ...)")``;
- a value of the wrong type raises ``ConfigError("trainer.steps: expected int, got str 'ten'")``;
- field constraints (``PositiveInt``...) and each section's ``model_post_init`` check ranges
  and choices and name the key they reject.

``splitrl config --schema`` prints the JSON schema (for editors' completion and checks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from splitrl.config_base import (  # noqa: F401  (re-exported: the config's public API)
    ConfigError,
    Section,
    load_yaml,
    merge_overrides,
    parse_override,
    validate,
)
from splitrl.recipes import apply_recipe


class LoraConfig(Section):
    """LoRA adapters, as in PEFT (``splitrl/models/lora.py``, docs/lora.md): only the adapters
    train, the base stays frozen, pushes carry only the adapters, the export adds a PEFT adapter
    directory.

    ``target_modules``: a regex that must match a whole Linear module name (PEFT's rule; the
    parameter name ``<module>.weight`` counts too), or a list of module names or their last
    part. ``path``: a PEFT adapter directory to start from; then rank, alpha and
    target_modules left unset are the adapter's. Unset without ``path``: rank 16, alpha
    2 x rank, every attention and MLP projection. ``dropout`` applies to the adapters' inputs
    in the trainer's forward.
    """

    rank: PositiveInt | None = None
    """Rank r of each adapter (null: the starting adapter's, else 16)."""
    alpha: PositiveFloat | None = None
    """LoRA alpha: the update is scaled by alpha / rank (null: the starting adapter's, else 2 x
    rank)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' inputs in the trainer's forward, in [0, 1)."""
    target_modules: str | list[str] | None = None
    """The Linear modules that get adapters: a regex matching a whole module name (PEFT's rule),
    or a list of names or their last part (null: the starting adapter's, else every
    attention and MLP projection)."""
    path: str | None = None
    """A PEFT adapter directory to start from (null: fresh adapters, B = 0)."""

    def model_post_init(self, _context) -> None:
        if isinstance(self.target_modules, str):
            import re

            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ConfigError(f"lora.target_modules: {self.target_modules!r} is not a "
                                  f"valid regex: {e}") from None
        elif self.target_modules is not None and not self.target_modules:
            raise ConfigError("lora.target_modules: expected a regex or a non-empty list of "
                              "module names, got []")


# The smallest sampling temperature other than 0 (greedy): logits / temperature must stay finite
# in float32 (|logits| of 1e4 / 1e-5 = 1e9), on the sampler and in the trainer's recomputation.
MIN_TEMPERATURE = 1e-5


def temperature_ok(value: float) -> bool:
    """0 (greedy) or at least MIN_TEMPERATURE (as float32 rounds it: requests carry float32)."""
    return value == 0 or value >= MIN_TEMPERATURE * (1 - 2**-23)


def check_temperature(key: str, value: float) -> None:
    """0 (greedy) or MIN_TEMPERATURE <= value; a ConfigError naming ``key`` otherwise."""
    if not temperature_ok(value):
        raise ConfigError(f"{key}: expected 0 (greedy) or >= {MIN_TEMPERATURE:g} (smaller "
                          f"temperatures overflow float32 logits / temperature), got {value!r}")


class ModelSection(Section):
    """Which checkpoint the policy starts from (a local Hugging Face directory or a hub name)."""

    path: str = "models/tiny-arith"
    """The policy's starting checkpoint: a local Hugging Face directory (config.json, safetensors,
    tokenizer) or a hub id (read from the hub, or its cache when HF_HUB_OFFLINE is set)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the trainer computes and keeps its weights in."""
    tokenizer_class: str | None = None
    """The `transformers` tokenizer class the checkpoint's tokenizer loads with (e.g.
    Qwen2Tokenizer); null: a checkpoint with a tokenizer.json loads it with the `tokenizers`
    library (the tokens and chat template transformers gives, without importing transformers
    in every service), any other with AutoTokenizer."""
    logprob_chunk_size: PositiveInt = 256
    """Tokens per chunk when the trainer computes log-probabilities over the vocabulary (bounds the
    logits held at once)."""
    remat: Literal["none", "full", "save_dots"] = "none"
    """What the train step's backward pass keeps of each decoder layer: "none" every activation
    (the fastest backward, the most memory), "full" only each layer's input (the layer is
    recomputed: activation memory of one layer), "save_dots" the layers' matmul outputs
    (recomputes the elementwise ops and attention's score products). bench/remat.py measures
    what each costs and saves."""
    attention: Literal["auto", "xla", "splash"] = "auto"
    """How the trainer's attention runs (docs/attention.md): "auto" the Pallas splash kernel
    on TPU (under a shard_map over the trainer's mesh) and XLA ops elsewhere (CPU's dense path
    unchanged); "xla" XLA ops everywhere (dense on CPU, memory-efficient blockwise on TPU and
    GPU); "splash" the kernel everywhere (on CPU in Pallas interpret mode: slow, for checking
    the kernel)."""
    layer_loop: Literal["auto", "scan", "unrolled"] = "auto"
    """How the trainer's programs apply the decoder layers: "scan" a `lax.scan` over the
    stacked layers (one layer body whatever the depth: compile time flat in depth),
    "unrolled" one layer after the other (a program that grows with depth, but XLA:CPU then
    copies no layer's weights or activations in and out of stacked buffers: a faster train
    step on CPU), "auto" unrolled on a CPU trainer, scanned on TPU and GPU. Values and
    gradients are the same either way."""
    lora: LoraConfig | None = None
    """LoRA adapters (off when null); e.g. model.lora.rank=16 turns them on."""


class MeshConfig(Section):
    """A device mesh for one service.

    Either give ``axes`` explicitly (``{"fsdp": 4}``, ``{"data": 1, "tensor": 2}``) or leave the
    size of one axis as -1 to take all selected devices. The devices are the slice
    ``[offset, offset + fraction * n)`` of the host's devices, so a trainer and a sampler can
    share one host the way MaxText splits trainer/sampler device fractions.
    """

    axes: dict[str, int] = Field(default_factory=lambda: {"fsdp": -1})
    """Mesh axes and their sizes, e.g. {fsdp: 4} or {data: 1, tensor: 2}; one size may be -1 (all
    selected devices)."""
    device_fraction: float = 1.0
    """The fraction of the host's devices this service takes, in (0, 1]."""
    device_offset: NonNegativeInt = 0
    """The index of the first device this service takes."""
    strategy: Literal["fsdp", "tp", "replicated"] = "fsdp"
    """How parameters are laid out on the mesh: "fsdp", "tp" (tensor parallel), "replicated"."""

    def model_post_init(self, _context) -> None:
        if not self.axes:
            raise ConfigError("mesh.axes: expected at least one axis, got {}")
        if sum(1 for v in self.axes.values() if v == -1) > 1:
            raise ConfigError(f"mesh.axes: at most one axis may be -1, got {self.axes}")
        for name, size in self.axes.items():
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.axes.{name}: expected a size >= 1 or -1, got {size}")
        if not 0.0 < self.device_fraction <= 1.0:
            raise ConfigError(
                f"mesh.device_fraction: expected 0 < fraction <= 1, got {self.device_fraction}"
            )

    def devices_needed(self) -> int:
        """The fewest devices a process needs for this mesh (a -1 axis gets one device): the
        device count a launcher or a CPU plan emulates for the service."""
        import math

        fixed = math.prod(v for v in self.axes.values() if v > 0)
        return max(1, int(math.ceil(fixed / self.device_fraction)) + self.device_offset)


class SamplingConfig(Section):
    """Sampling used for rollouts. Logprobs are reported under the temperature-scaled
    distribution (before top-k/top-p truncation), which the trainer reproduces exactly."""

    temperature: NonNegativeFloat = 1.0
    """Sampling temperature: 0 is greedy; otherwise at least 1e-5."""
    top_k: NonNegativeInt = 0
    """Sample among the k most likely tokens (0: no top-k truncation)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much probability, in (0, 1] (1: no
    truncation)."""
    max_new_tokens: PositiveInt = 8
    """The most tokens generated per completion."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's EOS."""
    stop_strings: list[str] = Field(default_factory=list)
    """Texts that end a completion, as transformers' generate(stop_strings=...): it keeps its
    tokens up to the one that completes the first of them (the samplers cut it there)."""
    seed: int = 0
    """Seed of requests whose prompts carry no seed of their own (Generate, evaluation tools).
    Training rollouts draw their noise from trainer.seed and each prompt's uid."""

    def model_post_init(self, _context) -> None:
        check_temperature("sampling.temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p: expected 0 < top_p <= 1, got {self.top_p}")


class RewardFunctionConfig(Section):
    """One reward function: a built-in name or ``module:function``, its weight and options."""

    name: str = "math_accuracy"
    """A built-in reward function (splitrl list rewards) or module:function, the module found beside
    the config file, in the current directory or installed."""
    weight: float = 1.0
    """The function's weight in a completion's total reward."""
    timeout_s: float | None = None
    """Time limit of one call (one prompt's group), in seconds (null: reward.timeout_s)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the function (a built-in's options: splitrl list rewards)."""


class RewardModelConfig(Section):
    """A reward model served by the reward service: a Hugging Face sequence-classification
    checkpoint (`XForSequenceClassification`, score head `score.weight`) run in JAX on
    ``reward.mesh``. A ``reward.functions`` entry with the same ``name`` scores with it, weighted
    like any function (docs/rewards.md)."""

    name: str
    """The name a reward.functions entry uses to score with this model."""
    path: str
    """The checkpoint: a local Hugging Face directory (config.json, safetensors, tokenizer) or a
    hub id (read from its cache when HF_HUB_OFFLINE is set)."""
    label: NonNegativeInt = 0
    """Which output of the score head is the reward (0 for a one-label reward model)."""
    max_batch_tokens: PositiveInt = 8192
    """Token budget of one forward: rows x padded length, filled from every waiting request."""
    max_length: PositiveInt = 2048
    """The longest input (prompt + completion, chat template applied) in tokens; a longer one
    scores 0 with an error reason."""
    use_chat_template: bool = True
    """Render the conversation (the prompt's messages or the prompt as a user turn, then the
    completion as the assistant turn) with the model's chat template; false, or a tokenizer
    without one: the prompt's text followed by the completion's."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the model computes and keeps its weights in."""
    tokenizer_class: str | None = None
    """The `transformers` tokenizer class (null: as ``model.tokenizer_class``)."""


class RewardJudgeConfig(Section):
    """An LLM judge: a model behind an OpenAI-compatible HTTP API (a SplitRL sampler deployment
    with sampler.http_port, vLLM, SGLang, a hosted API) whose verdict on a completion is its
    score. A ``reward.functions`` entry with the same ``name`` scores with it
    (``reward_service/judges.py``, docs/rewards.md)."""

    name: str
    """The name a reward.functions entry uses to score with this judge."""
    base_url: str
    """The API's base URL, e.g. http://judge-sampler:8001/v1."""
    model: str
    """The model name the endpoint serves (GET /v1/models)."""
    api: Literal["chat", "completions"] = "chat"
    """chat: the prompt is one user turn (/chat/completions); completions: raw text."""
    prompt_template: str = (
        "Question:\n{prompt}\n\nReference answer: {reference}\n\nResponse:\n{completion}"
        "\n\nIs the response correct? Answer YES or NO.")
    """The judge's prompt; {prompt}, {completion} and {reference} are filled in ({{ and }}
    are literal braces)."""
    verdict_pattern: str = r"\b(YES|NO)\b"
    """A regex; its first group (or whole match) in the judge's reply is the verdict."""
    verdict_scores: dict[str, float] = Field(default_factory=lambda: {"YES": 1.0, "NO": 0.0})
    """Score of each verdict; empty: the verdict is read as a number."""
    no_verdict_score: float | None = 0.0
    """The score when the reply has no verdict (reason 'judge gave no verdict'); null: an error
    (counted by the trainer's error policy)."""
    temperature: NonNegativeFloat = 0.0
    """Sampling temperature of the judge (0: greedy, reproducible, and safe to retry)."""
    seed: int | None = 0
    """Seed sent with each call (null: none); a seeded or greedy call is retried on failure."""
    max_tokens: PositiveInt = 16
    """The most tokens of a verdict."""
    max_concurrency: PositiveInt = 16
    """Calls in flight at once to this judge, per reward-service replica."""
    request_timeout_s: PositiveFloat = 60.0
    """Time limit of one call, in seconds."""
    max_retries: NonNegativeInt = 3
    """Retries of a call that failed for a reason that may pass (connection, time-out, HTTP
    408/429/5xx), with exponential back-off; only for idempotent (greedy or seeded) calls."""
    retry_backoff_s: PositiveFloat = 0.5
    """The first retry's wait; each next one waits twice as long."""
    cache_size: NonNegativeInt = 10000
    """Answers kept for identical requests (0: only calls in flight are shared)."""
    api_key_env: str | None = None
    """The environment variable holding the API key (sent as a bearer token); null: none."""

    def model_post_init(self, _context) -> None:
        import re

        try:
            re.compile(self.verdict_pattern)
        except re.error as e:
            raise ConfigError(f"reward.judges: verdict_pattern {self.verdict_pattern!r} is not "
                              f"a valid regex: {e}") from None
        try:
            self.prompt_template.format(prompt="", completion="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"reward.judges: prompt_template may use {{prompt}}, "
                              f"{{completion}} and {{reference}} only ({{{{ and }}}} for "
                              f"braces): {type(e).__name__}: {e}") from None


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig()]
    )
    """The reward functions; a completion's reward is their weighted sum."""
    models: list[RewardModelConfig] = Field(default_factory=list)
    """Reward models (sequence classifiers) the reward service serves; a function entry names one
    to score with it."""
    mesh: MeshConfig = Field(default_factory=lambda: MeshConfig(axes={"fsdp": -1}))
    """The reward service's device mesh, for its reward models (unused without them)."""
    judges: list[RewardJudgeConfig] = Field(default_factory=list)
    """LLM judges behind OpenAI-compatible HTTP APIs; a function entry names one to score with
    its verdicts."""
    workers: PositiveInt = 2
    """Scoring worker processes of the reward service."""
    timeout_s: PositiveFloat = 5.0
    """Default time limit of one reward function call, in seconds."""
    max_items_per_request: int = 4096
    """The most completions one Score request may carry."""
    max_request_bytes: int = 64 * 1024 * 1024
    """The largest Score request accepted, in bytes."""
    kill_grace_s: PositiveFloat = 0.5
    """A worker whose item overruns its time limit by this much is killed and replaced."""
    worker_memory_mb: PositiveInt | None = 4096
    """Address-space limit per scoring worker (MiB; None = unlimited): a runaway computation fails
    with MemoryError instead of exhausting the host."""
    accuracy_function: str | None = None
    """The function whose score measures correctness: evaluation accuracy and the training
    accuracy/mean metric are its mean score. None: the first of ``functions``."""
    max_error_fraction: float = 0.1
    """The trainer's error policy (docs/rewards.md): the run stops when a function fails (raises,
    returns the wrong number of scores or a non-number, times out) on more than this fraction
    of a step's completions (1: never stop)."""
    first_batch_max_error_fraction: float = 0.0
    """The error policy on the run's first batch (0: any error stops the run before it trains on
    it)."""

    def model_post_init(self, _context) -> None:
        names = [f.name for f in self.functions]
        served = [("models", m.name) for m in self.models] + [
            ("judges", j.name) for j in self.judges]
        for i, (key, name) in enumerate(served):
            index = sum(1 for k, _ in served[:i] if k == key)
            if name in [n for _, n in served[:i]]:
                raise ConfigError(f"reward.{key}[{index}].name: {name!r} is configured twice "
                                  "(reward.models and reward.judges share one namespace)")
            if name not in names:
                raise ConfigError(f"reward.{key}[{index}].name: {name!r} is not used by any "
                                  f"reward.functions entry (functions: {names})")
        if self.accuracy_function is not None and self.accuracy_function not in names:
            raise ConfigError(f"reward.accuracy_function: expected one of the configured "
                              f"functions {names}, got {self.accuracy_function!r}")
        for key in ("max_error_fraction", "first_batch_max_error_fraction"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"reward.{key}: expected a fraction in [0, 1] (1 = never "
                                  f"stop), got {value!r}")


class EnvironmentConfig(Section):
    """Multi-turn, tool-using episodes (docs/environments.md): the samplers run each completion
    as turns of the model and calls of the environment's tools."""

    name: str
    """A built-in environment (splitrl list environments) or module:Class (TRL's
    environment_factory convention: public methods are the tools)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    tool_format: Literal["auto", "qwen", "llama3", "tiny"] = "auto"
    """How the model writes a tool call; auto: from the chat template (qwen if it has
    <tool_call>, llama3 if it has Llama's ipython role, else tiny: `!name args`)."""
    max_turns: PositiveInt = 4
    """The most model turns of an episode."""
    max_tool_calls: PositiveInt = 8
    """The most tool calls of an episode, over all its turns."""
    max_total_tokens: PositiveInt | None = None
    """The most tokens after the prompt (generated and observation tokens together); null: what
    the sampler's max_sequence_length leaves after the prompt."""
    truncation: Literal["score", "mask"] = "score"
    """An episode that hits a limit: score it as it stands (score), or also mask all its
    tokens out of the loss (mask, DAPO's overlong filtering for episodes)."""
    workers: PositiveInt = 2
    """Tool worker processes per sampler (an episode's calls run on one; a worker runs one
    call at a time)."""
    tool_timeout_s: PositiveFloat = 10.0
    """Time limit of one tool call (and of an episode's reset), in seconds; an overrun becomes
    a time-out observation."""
    kill_grace_s: PositiveFloat = 1.0
    """A worker whose call overruns its time limit by this much is killed and replaced."""
    worker_memory_mb: PositiveInt | None = 2048
    """Address-space limit per tool worker (MiB; null: unlimited)."""
    max_observation_chars: PositiveInt = 4096
    """Longer tool results are cut to this many characters."""
    reward_weight: float = 1.0
    """The weight of the environment's own reward (its `reward` attribute at the end of an
    episode, reported as the reward "environment") in a completion's total."""


class AlgorithmConfig(Section):
    """The RL objective. Every GRPO-family variant is a combination of these switches; a
    ``recipe`` sets a paper's combination (``splitrl/recipes.py``, docs/algorithms.md), and any
    key set next to it overrides the recipe's value."""

    recipe: Literal["grpo", "dr_grpo", "dapo", "gspo", "gspo_token"] | None = None
    """A paper's combination of the switches below (grpo, dr_grpo, dapo, gspo, gspo_token;
    docs/algorithms.md); keys set beside it override it."""
    loss: Literal["grpo", "gspo", "gspo-token"] = "grpo"
    """The policy loss: grpo (token-level clipped ratio), gspo (sequence-level ratio) or gspo-
    token."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """The advantage estimator: grpo (group-normalised), drgrpo (group mean only) or rloo (leave-
    one-out baseline)."""
    advantage_std: Literal["group", "batch"] = "group"
    """What the advantage's standard deviation is taken over: each prompt's group, or the whole
    batch."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"
    ] = "token-mean"
    """How per-token losses become one number: token-mean, seq-mean-token-mean, seq-mean-token-
    sum or constant (Dr.GRPO: divided by constant_normalizer)."""
    constant_normalizer: PositiveInt | None = None
    """The token count that aggregation 'constant' divides by (null: sampling.max_new_tokens)."""
    eps_low: NonNegativeFloat | None = None
    """Lower clip range of the importance ratio (null: the loss's paper default, 0.2 for grpo, 3e-4
    for gspo)."""
    eps_high: NonNegativeFloat | None = None
    """Upper clip range of the importance ratio (null: the loss's paper default, 0.2 for grpo, 4e-4
    for gspo; DAPO raises it)."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 on negative-advantage ratios (null: off)."""
    beta: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the starting policy (0: no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The KL estimator for beta > 0: k1, k2 or k3 (Schulman's)."""
    tis_cap: PositiveFloat | None = 2.0
    """Truncated importance sampling against the sampler's logprobs: the weight's cap (null:
    off)."""
    logratio_clamp: PositiveFloat = 20.0
    """Every log-ratio is clamped to [-clamp, clamp] before exp, so one outlier token cannot
    overflow."""
    filter_zero_variance: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are not trained on, and more
    prompts are drawn until a step has prompts_per_step groups with signal."""
    max_extra_draws: NonNegativeInt | None = None
    """With filter_zero_variance: the most extra prompts drawn per step (null: 3 x
    prompts_per_step); then the step trains on what it has."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus in the loss (0: none)."""
    group_size: PositiveInt = 16
    """Completions sampled per prompt (G): the group advantages are computed over."""

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, values: Any) -> Any:
        return apply_recipe(values) if isinstance(values, dict) else values

    def model_post_init(self, _context) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algorithm.dual_clip: expected a value > 1, got {self.dual_clip}")


class OptimizerConfig(Section):
    lr: PositiveFloat = 1e-3
    """Peak learning rate (AdamW)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine decay to 0 at
    total_steps."""
    warmup_steps: NonNegativeInt = 0
    """Steps of linear warm-up from 0 to lr."""
    total_steps: int | None = None
    """The step the linear or cosine schedule reaches 0 at (needed by those schedules)."""
    b1: float = 0.9
    """AdamW's first-moment decay."""
    b2: float = 0.999
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global norm (null: no clipping)."""


class CheckpointConfig(Section):
    dir: str | None = None
    """Where checkpoints go (null: <run_dir>/checkpoints)."""
    every: PositiveInt = 10
    """Save a checkpoint every N steps (and at the end of the run)."""
    keep: PositiveInt = 2
    """How many of the newest checkpoints are kept."""
    async_save: bool = True
    """Write checkpoints in the background while training goes on."""


class DataConfig(Section):
    """Where prompts come from. ``task`` is a built-in (arithmetic, gsm8k, math500) or
    ``files`` for local json/jsonl/parquet files or a hub dataset name (docs/data.md).

    ``max_prompt_tokens`` bounds a prompt as the sampler encodes it (system prompt and chat
    template included); None = ``sampler.max_sequence_length - sampling.max_new_tokens``, the
    longest prompt a sampler accepts. Longer rows are found when the data is loaded and, by
    ``long_prompt_policy``, dropped, cut from the left (the start of the prompt's text; the
    system prompt and the template stay) or refused with an error: never sent to a sampler.
    """

    task: str = "arithmetic"
    """Where prompts come from: a built-in task (arithmetic, gsm8k, math500; splitrl list tasks) or
    files (local json/jsonl/parquet/csv, or a hub dataset)."""
    path: str | None = None
    """The data's file, directory or hub dataset name (null: the task's default)."""
    split: str = "train"
    """The split trained on."""
    eval_split: str | None = "test"
    """The split evaluated on (greedy accuracy before, during and after training; null: none)."""
    prompt_field: str = "question"
    """With task files: the column holding the prompt."""
    answer_field: str = "answer"
    """With task files: the column holding the reference answer."""
    system_prompt: str | None = None
    """A system prompt put before every prompt (a system message with chat_template)."""
    chat_template: bool = False
    """Render plain-text prompts as a user message through the tokenizer's chat template."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the training rows."""
    epochs: int | None = None
    """Passes over the training rows (null: the stream never ends; the run stops at
    trainer.steps)."""
    eval_size: int | None = None
    """Evaluate on the first N rows of eval_split (null: all of them)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The task's own options (splitrl list tasks)."""
    max_prompt_tokens: PositiveInt | None = None
    """The longest prompt in tokens, as the sampler encodes it (null: sampler.max_sequence_length -
    sampling.max_new_tokens)."""
    long_prompt_policy: Literal["drop", "truncate_left", "error"] = "drop"
    """What happens to longer prompts when the data is loaded: drop, truncate_left (the start of the
    prompt's text goes) or error."""


class DistributedConfig(Section):
    """Multi-host JAX for the trainer (``jax.distributed.initialize``); see splitrl/distributed.py.

    All fields are optional. A single process (the default) initializes nothing. Unset fields are
    detected from the environment: ``process_id`` from ``JOB_COMPLETION_INDEX`` (a Kubernetes
    indexed Job), and on a multi-host Cloud TPU slice JAX finds coordinator and ranks by itself.
    """

    coordinator_address: str | None = None
    """host:port of process 0, e.g. trainer-0.trainer-workers:8476 in an indexed Job (null:
    detected)."""
    num_processes: PositiveInt | None = None
    """The number of trainer processes (null: detected)."""
    process_id: NonNegativeInt | None = None
    """This process's rank (null: JOB_COMPLETION_INDEX, or detected on a TPU slice)."""
    initialization_timeout_s: PositiveInt = 300
    """How long jax.distributed.initialize waits for every process, in seconds."""

    def model_post_init(self, _context) -> None:
        if (
            self.num_processes is not None
            and self.process_id is not None
            and self.process_id >= self.num_processes
        ):
            raise ConfigError(
                f"distributed.process_id: expected a value < num_processes "
                f"({self.num_processes}), got {self.process_id}"
            )
        if self.coordinator_address is not None:
            host, sep, port = self.coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(
                    "distributed.coordinator_address: expected 'host:port', "
                    f"got {self.coordinator_address!r}"
                )


class PushConfig(Section):
    """How the trainer sends its weights to the samplers (docs/weight-sync.md)."""

    transport: Literal["bulk", "grpc"] = "bulk"
    """"bulk": the data plane of every sampler that offers one (GetInfo.data_address), gRPC
    PushWeights for any other; "grpc": PushWeights only."""
    relay: bool = True
    """Samplers with the same layout form one chain that relays the push, so the trainer sends each
    byte once however many samplers there are (bulk transport)."""
    delta: bool = True
    """Send only the elements that changed since the version a sampler holds, chunk by chunk when
    that is smaller (bulk transport; the trainer keeps a host copy of the last push)."""
    timeout_s: PositiveFloat = 300.0
    """One push, from the first byte to the last sampler's final report."""
    idle_timeout_s: PositiveFloat = 30.0
    """A data-plane peer that says nothing for this long has failed."""
    straggler_wait_s: PositiveFloat = 10.0
    """Once one sampler has a push, the trainer waits this long for the others and goes on; a
    slow or stopped sampler's push finishes (or fails) in the background, and it gets work
    again once it holds recent enough weights."""


class TrainerConfig(Section):
    steps: NonNegativeInt = 100
    """Training steps (optimizer updates) of the run."""
    prompts_per_step: PositiveInt = 16
    """Prompts per step; each gets algorithm.group_size completions."""
    micro_batch_size: PositiveInt | None = None
    """Completions per forward/backward pass; gradients add up over a step's micro-batches (null:
    the whole batch at once)."""
    epochs_per_batch: PositiveInt = 1
    """Optimizer updates per batch of rollouts (PPO epochs); later ones are measured against the
    first."""
    max_staleness: NonNegativeInt = 0
    """How many versions behind the trained policy a rollout may be (0: synchronous, on-policy; k
    > 0: samplers keep generating while the trainer trains)."""
    prompts_per_request: PositiveInt | None = None
    """Prompts per Rollout request. In a synchronous run (max_staleness 0) a step's prompts are cut
    into requests of this size in draw order, so the run is the same whichever sampler answers
    first and however many samplers there are. None: half a step, at most one sampler batch
    (sampler.max_batch_size // group_size). Asynchronous runs fill each sampler up to its
    capacity instead."""
    push_every: PositiveInt = 1
    """Push new weights to the samplers every N steps (at most max_staleness + 1)."""
    rollout_timeout_s: PositiveFloat = 600.0
    """Deadline of one Rollout call to a sampler, from sending the request (its prompts x
    algorithm.group_size completions, generated and scored) to its last scored group. A call
    past it counts as a sampler failure and its prompts go to another sampler. Raise it where
    one request is slow (a deep model on CPU, long completions, a large request); lower it to
    give up on a hung sampler sooner. It must exceed sampler.reward_timeout_s: a request
    includes scoring."""
    seed: int = 0
    """The run's seed: with the prompt's uid it makes the noise of every completion."""
    run_dir: str = "runs/latest"
    """The run's directory: its config, logs, metrics.jsonl, checkpoints, plots and export."""
    eval_before: bool = True
    """Greedy evaluation on data.eval_split before the first step."""
    eval_after: bool = True
    """Greedy evaluation on data.eval_split after the last step."""
    eval_every: PositiveInt | None = None
    """Greedy evaluation every N steps during the run (metrics eval/*; None: only before/after)."""
    log_every: PositiveInt = 1
    """Log a step line to the trainer's log every N steps."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Experiment trackers besides metrics.jsonl: "tensorboard" (event files in
    <run_dir>/tensorboard) and/or "wandb" (WANDB_MODE=offline writes <run_dir>/wandb)."""
    completions_every: NonNegativeInt = 10
    """A table of sample completions goes to the trackers every N steps (0: never)."""
    resume: Literal["check", "force"] = "check"
    """A run dir that holds a checkpoint resumes only with the same model, algorithm and data
    ("check"; a different config is refused, naming the keys); "force" resumes regardless."""
    mesh: MeshConfig = Field(default_factory=lambda: MeshConfig(axes={"fsdp": -1}))
    """The trainer's device mesh (default: FSDP over all its devices)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """The optimizer (AdamW) and its learning-rate schedule."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Where and how often the trainer checkpoints."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompts: task, files, splits, formatting."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Multi-host trainer settings (jax.distributed)."""
    push: PushConfig = Field(default_factory=PushConfig)
    """How weights reach the samplers."""

    def model_post_init(self, _context) -> None:
        if self.push_every > self.max_staleness + 1:
            raise ConfigError(
                f"trainer.push_every: samplers must get new weights at least every "
                f"max_staleness + 1 = {self.max_staleness + 1} steps, or no sampler may "
                f"generate the next step's rollouts; got {self.push_every}")
        evals = [key for key in ("eval_before", "eval_after") if getattr(self, key)]
        if evals and self.data.eval_split is None:
            raise ConfigError(
                f"trainer.{evals[0]}: {' and '.join(evals)} true but trainer.data.eval_split is "
                "null: there is nothing to evaluate on (set an eval_split, or "
                f"{' '.join(f'trainer.{k}=false' for k in evals)})")


class SamplerConfig(Section):
    max_batch_size: PositiveInt = 256
    """The most sequences a sampler decodes at once."""
    max_sequence_length: PositiveInt = 256
    """The longest sequence (prompt + completion) in tokens a sampler accepts."""
    max_chunk_bytes: PositiveInt = 4 * 1024 * 1024 - 64 * 1024
    """The largest weight chunk a sampler accepts in a push, in bytes (under gRPC's message
    limit)."""
    mesh: MeshConfig = Field(
        default_factory=lambda: MeshConfig(axes={"tensor": -1}, strategy="tp")
    )
    """A sampler's device mesh (default: tensor parallel over all its devices)."""
    sampler_id: str = ""
    """Reported in GetInfo and every ScoredGroup; "" = advertised host:port."""
    reward_timeout_s: PositiveFloat = 120.0
    """Deadline of one Score call to the reward service."""
    shutdown_grace_s: NonNegativeFloat = 30.0
    """On SIGTERM: how long in-flight calls may take to finish before the server exits."""
    register_with_trainer: bool = True
    """Announce this sampler to the trainer at services.trainer_address (RegisterSampler, then
    Heartbeat every services.heartbeat_s); retried quietly while the trainer is not up."""
    kv_cache_bytes: NonNegativeInt = 0
    """Memory for the decode KV cache, in bytes; 0 = what max_batch_size sequences of
    max_sequence_length need. The engine never allocates more (sequences beyond it queue);
    GetInfo's max_batch_size is min(max_batch_size, sequences of max_sequence_length that fit),
    so a trainer's capacity is always admissible."""
    batching: Literal["continuous", "static"] = "continuous"
    """"continuous": finished sequences' decode slots are refilled from waiting prompts between
    segments; "static": a batch decodes until its last sequence ends (for comparison)."""
    segment_steps: PositiveInt = 16
    """Decode steps per compiled segment (between segments slots are retired and refilled)."""
    prefill_chunk_tokens: PositiveInt = 8192
    """Prompt tokens (packed, padding included) one prefill program computes: the prompts
    admitted at a segment boundary are prefilled in chunks of at most this many, each written
    into the KV cache (and its first tokens drawn) before the next, so prefill's activations
    and keys/values are bounded whatever the batch. A prompt is never split: one longer than
    this (set it >= max_sequence_length to rule that out) is a chunk of its own."""
    decode_attention: Literal["auto", "xla", "paged"] = "auto"
    """How decode attention runs (docs/attention.md): "auto" the Pallas paged_attention kernel
    on TPU over the cache laid out as pages, XLA ops elsewhere (CPU unchanged); "xla" XLA ops
    over the slot cache everywhere; "paged" the paged layout everywhere (off TPU its attention
    runs in XLA ops: for checking the layout)."""
    kv_page_size: PositiveInt = 64
    """Tokens per page of the paged KV cache (a multiple of 16, so a bfloat16 page fills whole
    TPU tiles; docs/attention.md)."""
    kv_pages: NonNegativeInt = 0
    """Pages in each batch's page pool (the paged KV cache, by default on TPU): its memory,
    whatever the rows; a prompt whose rows' pages (prompt + max_new_tokens each) are not free
    waits. 0 = what kv_cache_bytes holds, or enough for max_batch_size sequences of
    max_sequence_length. Unused by the slot cache (CPU by default)."""
    kv_pages_per_sequence: PositiveInt | None = None
    """The page table's width: the most pages one sequence holds, so kv_page_size x this
    bounds max_sequence_length. None = what max_sequence_length needs."""
    concurrent_batches: PositiveInt | None = None
    """Batches decoding at once, each with its own thread and KV cache (kv_cache_bytes each):
    requests share one batch; exclusive (reproducible) requests take a batch each, so a
    synchronous step's requests decode together. None: 2 on CPU devices with >= 2 cores, 1
    on accelerators (docs/sampler.md)."""
    update_in_flight: bool = False
    """Apply a weight push to sequences in flight at the next segment boundary (their
    Completion.weight_versions then list every version); false = a sequence finishes on the
    weights it started with and a push waits until they drain."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype the sampler serves (None: model.dtype). "bfloat16" with float32 training: the
    trainer keeps float32 master weights and sends bfloat16 (half the bytes)."""
    data_port: NonNegativeInt | None = 0
    """The bulk weight data plane (docs/weight-sync.md): its TCP port on services.host (0: any free
    port; advertised in GetInfo), or None for gRPC PushWeights only."""
    push_idle_timeout_s: PositiveFloat = 30.0
    """A push (either transport) that sends nothing for this long is abandoned, releasing the push
    lock; a relay declares its next sampler gone after this long without a word."""
    http_port: NonNegativeInt | None = None
    """The OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models;
    docs/sampler.md): its TCP port on services.host (0: any free port), or None for none."""
    served_model_name: str | None = None
    """The model's name on the HTTP API (the "model" field of requests and /v1/models; null:
    model.path)."""

    def model_post_init(self, _context) -> None:
        if self.kv_page_size % 16:
            raise ConfigError(f"sampler.kv_page_size: expected a multiple of 16 (a bfloat16 "
                              f"page fills whole TPU tiles), got {self.kv_page_size}")
        longest = -(-self.max_sequence_length // self.kv_page_size)
        per_sequence = self.kv_pages_per_sequence
        if per_sequence is not None and per_sequence < longest:
            raise ConfigError(
                f"sampler.kv_pages_per_sequence: {per_sequence} pages of kv_page_size "
                f"{self.kv_page_size} hold {per_sequence * self.kv_page_size} tokens, fewer than "
                f"max_sequence_length {self.max_sequence_length} (needs {longest})")
        if self.kv_pages and self.kv_pages < longest:
            raise ConfigError(
                f"sampler.kv_pages: {self.kv_pages} pages of kv_page_size {self.kv_page_size} "
                f"hold no sequence of max_sequence_length {self.max_sequence_length} (one needs "
                f"{longest})")
        if self.kv_pages and self.kv_cache_bytes:
            raise ConfigError("sampler.kv_pages and sampler.kv_cache_bytes both size the KV "
                              "page pool: set one")
        for key in ("data_port", "http_port"):
            port = getattr(self, key)
            if port is not None and port > 65535:
                raise ConfigError(f"sampler.{key}: expected a TCP port <= 65535, got {port}")


class AuthConfig(Section):
    """Who may call the services (``splitrl/auth.py``; threat model in docs/security.md).

    The shared token is ``token``, else env ``token_env``, else ``token_file``. With a token set
    every RPC of every service needs it except ``open_methods``. TLS: servers serve
    ``tls_cert``/``tls_key``; clients verify them against ``tls_ca``. ``tls_client_auth`` makes
    it mutual: servers require a client certificate signed by ``tls_ca`` and every client
    channel presents ``tls_cert``/``tls_key`` (one certificate per process, valid for both).
    """

    token: str | None = None
    """The shared token every RPC must carry (null: token_env, then token_file, else no token)."""
    token_env: str = "SPLITRL_AUTH_TOKEN"
    """The environment variable holding the token when token is null."""
    token_file: str | None = None
    """A file holding the token when neither token nor token_env gives one."""
    open_methods: list[str] = Field(default_factory=lambda: [
        "grpc.health.v1.Health/Check", "splitrl.v1.Trainer/Status"])
    """"package.Service/Method" callable without the token. Health/Check: Kubernetes' gRPC probes
    and `splitrl health` send no token. Trainer/Status: read-only progress."""
    tls_cert: str | None = None
    """This process's certificate (PEM): what servers serve, and what clients present with
    tls_client_auth."""
    tls_key: str | None = None
    """The private key of tls_cert (PEM)."""
    tls_ca: str | None = None
    """The CA certificate peers are verified against (clients: enables TLS)."""
    tls_client_auth: bool = False
    """Mutual TLS: servers require a client certificate signed by tls_ca."""
    tls_server_name: str | None = None
    """The name clients expect in server certificates (default: the host of the address), so one
    certificate can serve pods whose IPs change."""

    def model_post_init(self, _context) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            unset, other = ("tls_key", "tls_cert") if self.tls_cert else ("tls_cert", "tls_key")
            raise ConfigError(f"auth.{unset}: expected a file since {other} is set (a "
                              f"certificate and its key go together), got None")
        if self.tls_client_auth and not (self.tls_ca and self.tls_cert):
            raise ConfigError(
                "auth.tls_client_auth: mutual TLS needs tls_ca (to verify peers) and "
                f"tls_cert/tls_key (to present), got tls_ca={self.tls_ca!r}, "
                f"tls_cert={self.tls_cert!r}")
        if self.open_methods:
            from splitrl.auth import rpc_methods

            known = rpc_methods()
            for i, method in enumerate(self.open_methods):
                if method not in known:
                    raise ConfigError(
                        f"auth.open_methods[{i}]: expected one of {known}, got {method!r}")


class ServicesConfig(Section):
    """Addresses and membership. The same section drives the launcher, compose and Kubernetes."""

    host: str = "127.0.0.1"
    """The address services listen on."""
    advertise_host: str | None = None
    """The host other services use to reach this one (samplers register with it). None: ``host``
    unless that is a wildcard (0.0.0.0), then this machine's hostname."""
    reward_address: str = "127.0.0.1:50100"
    """host:port of the reward service."""
    trainer_address: str = "127.0.0.1:50200"
    """host:port of the trainer."""
    sampler_port: int = 50300
    """The port a sampler listens on."""
    sampler_addresses: list[str] = Field(default_factory=list)
    """Static sampler addresses (host:port) the trainer uses."""
    sampler_dns: str | None = None
    """name:port resolving to every sampler (a compose service, a headless Service), resolved
    again on every membership refresh."""
    num_samplers: NonNegativeInt = 2
    """Samplers splitrl up starts."""
    heartbeat_s: PositiveFloat = 2.0
    """Seconds between a sampler's heartbeats to the trainer."""
    sampler_timeout_s: float = 10.0
    """A sampler silent for this long is dropped; its rollouts in flight go to others."""
    sampler_max_internal_failures: PositiveInt = 3
    """A sampler whose rollouts fail inside it (gRPC INTERNAL) this many times in a row is
    refused: dropped, its prompts go to others, its address tried again after
    ``sampler_timeout_s`` (ready again once a rollout of it completes); with every sampler
    refused the trainer reports the run stalled, and stops after ``sampler_wait_s``."""
    sampler_wait_s: PositiveFloat = 600.0
    """How long the trainer waits with no sampler ready to take work, at start or at any time
    later (every sampler refused, unreachable or still syncing), before the run stops with exit
    code 4 naming each sampler and why; it checkpoints first, so the same command resumes. A
    sampler that restarts within it is waited for."""
    metrics_port: int | None = None
    """The Prometheus /metrics port of each service (null: none; splitrl up gives each process a
    free port of its own)."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """Who may call the services: token and TLS."""


class Config(Section):
    """The whole run. Each service reads the sections it needs."""

    run_name: str = "splitrl"
    """The run's name (logs, trackers)."""
    model: ModelSection = Field(default_factory=ModelSection)
    """The policy's starting checkpoint and how it is held."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How completions are sampled."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """The reward functions and the reward service."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """The RL objective (GRPO-family switches)."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer: steps, batch, data, optimizer, checkpoints, evaluation."""
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    """The samplers: batch, sequence length, mesh, KV cache, weight intake."""
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    """Addresses, membership and security of the services."""
    environment: EnvironmentConfig | None = None
    """Multi-turn tool use (null: one completion per prompt)."""

    def model_post_init(self, _context) -> None:
        if self.trainer.rollout_timeout_s <= self.sampler.reward_timeout_s:
            raise ConfigError(
                f"trainer.rollout_timeout_s: a Rollout call includes scoring, so it must "
                f"exceed sampler.reward_timeout_s={self.sampler.reward_timeout_s:g}; got "
                f"{self.trainer.rollout_timeout_s:g} (raise it, or lower "
                f"sampler.reward_timeout_s)")
        room = self.sampler.max_sequence_length - self.sampling.max_new_tokens
        if room < 1:
            raise ConfigError(
                f"sampling.max_new_tokens: {self.sampling.max_new_tokens} leaves no room for a "
                f"prompt in sampler.max_sequence_length={self.sampler.max_sequence_length}")
        limit = self.trainer.data.max_prompt_tokens
        if limit is not None and limit > room:
            raise ConfigError(
                f"trainer.data.max_prompt_tokens: {limit} + sampling.max_new_tokens="
                f"{self.sampling.max_new_tokens} exceeds sampler.max_sequence_length="
                f"{self.sampler.max_sequence_length}: samplers would refuse such prompts "
                f"(at most {room}, or leave it unset)")

    def prompt_token_limit(self) -> int:
        """The longest prompt (in tokens, as the sampler encodes it) the run sends."""
        room = self.sampler.max_sequence_length - self.sampling.max_new_tokens
        limit = self.trainer.data.max_prompt_tokens
        return room if limit is None else limit


# ----------------------------------------------------------------------------------------------
# Loading


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Section ``cls`` from plain data, rejecting unknown keys and wrong types."""
    return validate(cls, data)


def to_dict(cfg: Section) -> dict[str, Any]:
    return cfg.model_dump()


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (YAML; None = defaults) and apply ``a.b.c=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = load_yaml(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
        data = loaded
    return validate(Config, merge_overrides(data, list(overrides)))


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (``splitrl config --schema``)."""
    return Config.model_json_schema()
