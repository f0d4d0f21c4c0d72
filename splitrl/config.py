"""One typed config for every service.

A run is described by one YAML file; each service reads its own section. Dotted overrides on the
command line (``trainer.steps=50``) are applied on top. Loading is strict, because a typo in a
key must fail fast with the key's name instead of silently training with a default:

- an unknown key raises ``ConfigError("unknown key 'trainer.stpes' (known: ...)")``;
- a value of the wrong type raises ``ConfigError("trainer.steps: expected int, got str 'ten'")``;
- ``__post_init__`` validators check ranges and choices and name the key they reject.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or holds a value out of range."""


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: expected one of {list(choices)}, got {value!r}")


def _check_positive(key: str, value: float | int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}: expected a value {bound}, got {value!r}")


@dataclass
class LoraConfig:
    """LoRA adapters, as in PEFT (``splitrl/models/lora.py``): only the adapters train, the base
    stays frozen, pushes carry only the adapters, the export adds a PEFT adapter directory.

    ``target_modules``: a regex that must match a whole Linear module name (PEFT's rule; the
    parameter name ``<module>.weight`` counts too), or a list of module names or their last
    part. ``path``: a PEFT adapter directory to start from; then rank, alpha and
    target_modules left unset are the adapter's. Unset without ``path``: rank 16, alpha
    2 x rank, every attention and MLP projection. ``dropout`` applies to the adapters' inputs
    in the trainer's forward (an ``lm_head`` adapter is applied as a merged weight, without it).
    """

    rank: int | None = None
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: str | list[str] | None = None
    path: str | None = None

    def __post_init__(self):
        _check_positive("lora.rank", self.rank)
        _check_positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout: expected 0 <= dropout < 1, got {self.dropout!r}")
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


@dataclass
class ModelSection:
    """Which checkpoint the policy starts from (a local Hugging Face directory or a hub name)."""

    path: str = "models/tiny-arith"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Attention/logit chunking for the training path (tokens per chunk).
    logprob_chunk_size: int = 256
    # LoRA adapters (off when null); e.g. model.lora.rank=16 turns them on.
    lora: LoraConfig | None = None

    def __post_init__(self):
        _check_positive("model.logprob_chunk_size", self.logprob_chunk_size)


@dataclass
class MeshConfig:
    """A device mesh for one service.

    Either give ``axes`` explicitly (``{"fsdp": 4}``, ``{"data": 1, "tensor": 2}``) or leave the
    size of one axis as -1 to take all selected devices. The devices are the slice
    ``[offset, offset + fraction * n)`` of the host's devices, so a trainer and a sampler can
    share one host the way MaxText splits trainer/sampler device fractions.
    """

    axes: dict[str, int] = field(default_factory=lambda: {"fsdp": -1})
    device_fraction: float = 1.0
    device_offset: int = 0
    # How parameters are laid out on the mesh: "fsdp", "tp" (tensor parallel), "replicated".
    strategy: Literal["fsdp", "tp", "replicated"] = "fsdp"

    def __post_init__(self):
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
        _check_positive("mesh.device_offset", self.device_offset, allow_zero=True)


@dataclass
class SamplingConfig:
    """Sampling used for rollouts. Logprobs are reported under the temperature-scaled
    distribution (before top-k/top-p truncation), which the trainer reproduces exactly."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: list[int] = field(default_factory=list)
    # Seed of requests whose prompts carry no seed of their own (Generate, evaluation tools).
    # Training rollouts draw their noise from trainer.seed and each prompt's uid.
    seed: int = 0

    def __post_init__(self):
        _check_positive("sampling.temperature", self.temperature, allow_zero=True)
        _check_positive("sampling.top_k", self.top_k, allow_zero=True)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p: expected 0 < top_p <= 1, got {self.top_p}")
        _check_positive("sampling.max_new_tokens", self.max_new_tokens)


@dataclass
class RewardFunctionConfig:
    """One reward function: a built-in name or ``module:function``, its weight and options."""

    name: str = "math_accuracy"
    weight: float = 1.0
    timeout_s: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(
        default_factory=lambda: [RewardFunctionConfig()]
    )
    workers: int = 2
    timeout_s: float = 5.0
    max_items_per_request: int = 4096
    max_request_bytes: int = 64 * 1024 * 1024
    # A worker whose item overruns its time limit by this much is killed and replaced.
    kill_grace_s: float = 0.5
    # Address-space limit per scoring worker (MiB; None = unlimited): a runaway computation
    # fails with MemoryError instead of exhausting the host.
    worker_memory_mb: int | None = 4096
    # The function whose score measures correctness: evaluation accuracy and the training
    # accuracy/mean metric are its mean score. None: the first of ``functions``.
    accuracy_function: str | None = None
    # The trainer's error policy (docs/rewards.md): the run stops when a function fails (raises,
    # returns the wrong number of scores or a non-number, times out) on more than this fraction
    # of a step's completions; on the run's first batch, errors are held to
    # first_batch_max_error_fraction (0: any error stops the run before it trains on it).
    max_error_fraction: float = 0.1
    first_batch_max_error_fraction: float = 0.0

    def __post_init__(self):
        names = [f.name for f in self.functions]
        if self.accuracy_function is not None and self.accuracy_function not in names:
            raise ConfigError(f"reward.accuracy_function: expected one of the configured "
                              f"functions {names}, got {self.accuracy_function!r}")
        for key in ("max_error_fraction", "first_batch_max_error_fraction"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"reward.{key}: expected a fraction in [0, 1] (1 = never "
                                  f"stop), got {value!r}")
        _check_positive("reward.workers", self.workers)
        _check_positive("reward.timeout_s", self.timeout_s)
        _check_positive("reward.kill_grace_s", self.kill_grace_s)
        _check_positive("reward.worker_memory_mb", self.worker_memory_mb)


@dataclass
class AlgorithmConfig:
    """The RL objective. Every GRPO-family variant is a combination of these switches."""

    loss: Literal["grpo", "gspo", "gspo-token"] = "grpo"
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    advantage_std: Literal["group", "batch"] = "group"
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"
    ] = "token-mean"
    constant_normalizer: int | None = None
    # None = the loss's paper default (0.2/0.2 for grpo, 3e-4/4e-4 for gspo).
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | None = None
    beta: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    tis_cap: float | None = 2.0
    logratio_clamp: float = 20.0
    # DAPO's dynamic sampling: groups whose rewards are all equal are not trained on; the
    # trainer draws more prompts until a step has prompts_per_step groups with signal, at most
    # max_extra_draws more per step (None: 3 x prompts_per_step), then trains on what it has.
    filter_zero_variance: bool = False
    max_extra_draws: int | None = None
    entropy_coef: float = 0.0
    group_size: int = 16

    def __post_init__(self):
        _check_positive("algorithm.beta", self.beta, allow_zero=True)
        _check_positive("algorithm.group_size", self.group_size)
        _check_positive("algorithm.max_extra_draws", self.max_extra_draws, allow_zero=True)
        _check_positive("algorithm.constant_normalizer", self.constant_normalizer)
        _check_positive("algorithm.eps_low", self.eps_low, allow_zero=True)
        _check_positive("algorithm.eps_high", self.eps_high, allow_zero=True)
        _check_positive("algorithm.tis_cap", self.tis_cap)
        _check_positive("algorithm.logratio_clamp", self.logratio_clamp)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"algorithm.dual_clip: expected a value > 1, got {self.dual_clip}")


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        _check_positive("optimizer.lr", self.lr)
        _check_positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: <run_dir>/checkpoints
    every: int = 10
    keep: int = 2
    async_save: bool = True

    def __post_init__(self):
        _check_positive("checkpoint.every", self.every)
        _check_positive("checkpoint.keep", self.keep)


@dataclass
class DataConfig:
    """Where prompts come from. ``task`` is a built-in (arithmetic, gsm8k, math500) or
    ``files`` for local json/jsonl/parquet files or a hub dataset name (docs/data.md).

    ``max_prompt_tokens`` bounds a prompt as the sampler encodes it (system prompt and chat
    template included); None = ``sampler.max_sequence_length - sampling.max_new_tokens``, the
    longest prompt a sampler accepts. Longer rows are found when the data is loaded and, by
    ``long_prompt_policy``, dropped, cut from the left (the start of the prompt's text; the
    system prompt and the template stay) or refused with an error: never sent to a sampler.
    """

    task: str = "arithmetic"
    path: str | None = None
    split: str = "train"
    eval_split: str | None = "test"
    prompt_field: str = "question"
    answer_field: str = "answer"
    system_prompt: str | None = None
    chat_template: bool = False
    shuffle_seed: int = 0
    epochs: int | None = None
    eval_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    max_prompt_tokens: int | None = None
    long_prompt_policy: Literal["drop", "truncate_left", "error"] = "drop"

    def __post_init__(self):
        _check_positive("data.max_prompt_tokens", self.max_prompt_tokens)


@dataclass
class DistributedConfig:
    """Multi-host JAX for the trainer (``jax.distributed.initialize``); see splitrl/distributed.py.

    All fields are optional. A single process (the default) initializes nothing. Unset fields are
    detected from the environment: ``process_id`` from ``JOB_COMPLETION_INDEX`` (a Kubernetes
    indexed Job), and on a multi-host Cloud TPU slice JAX finds coordinator and ranks by itself.
    """

    # "host:port" of process 0, e.g. trainer-0.trainer-workers:8476 in an indexed Job.
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self):
        _check_positive("distributed.num_processes", self.num_processes)
        _check_positive("distributed.process_id", self.process_id, allow_zero=True)
        _check_positive("distributed.initialization_timeout_s", self.initialization_timeout_s)
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


@dataclass
class PushConfig:
    """How the trainer sends its weights to the samplers (docs/weight-sync.md)."""

    # "bulk": the data plane of every sampler that offers one (GetInfo.data_address), gRPC
    # PushWeights for any other; "grpc": PushWeights only.
    transport: Literal["bulk", "grpc"] = "bulk"
    # Samplers with the same layout form one chain that relays the push, so the trainer sends
    # each byte once however many samplers there are (bulk transport).
    relay: bool = True
    # Send only the elements that changed since the version a sampler holds, chunk by chunk
    # when that is smaller (bulk transport; the trainer keeps a host copy of the last push).
    delta: bool = True
    # One push, from the first byte to the last sampler's final report.
    timeout_s: float = 300.0
    # A data-plane peer that says nothing for this long has failed.
    idle_timeout_s: float = 30.0

    def __post_init__(self):
        _check_positive("trainer.push.timeout_s", self.timeout_s)
        _check_positive("trainer.push.idle_timeout_s", self.idle_timeout_s)


@dataclass
class TrainerConfig:
    steps: int = 100
    prompts_per_step: int = 16
    micro_batch_size: int | None = None
    epochs_per_batch: int = 1
    max_staleness: int = 0
    # Prompts per Rollout request. In a synchronous run (max_staleness 0) a step's prompts are
    # cut into requests of this size in draw order, so the run is the same whichever sampler
    # answers first and however many samplers there are. None: half a step, at most one
    # sampler batch (sampler.max_batch_size // group_size). Asynchronous runs fill each
    # sampler up to its capacity instead.
    prompts_per_request: int | None = None
    push_every: int = 1
    # The run's seed: with the prompt's uid it makes the noise of every completion.
    seed: int = 0
    run_dir: str = "runs/latest"
    eval_before: bool = True
    eval_after: bool = True
    log_every: int = 1
    mesh: MeshConfig = field(default_factory=lambda: MeshConfig(axes={"fsdp": -1}))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    push: PushConfig = field(default_factory=PushConfig)

    def __post_init__(self):
        _check_positive("trainer.steps", self.steps, allow_zero=True)
        _check_positive("trainer.prompts_per_step", self.prompts_per_step)
        _check_positive("trainer.micro_batch_size", self.micro_batch_size)
        _check_positive("trainer.epochs_per_batch", self.epochs_per_batch)
        _check_positive("trainer.max_staleness", self.max_staleness, allow_zero=True)
        _check_positive("trainer.push_every", self.push_every)
        _check_positive("trainer.prompts_per_request", self.prompts_per_request)
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


@dataclass
class SamplerConfig:
    max_batch_size: int = 256
    max_sequence_length: int = 256
    max_chunk_bytes: int = 4 * 1024 * 1024 - 64 * 1024
    mesh: MeshConfig = field(
        default_factory=lambda: MeshConfig(axes={"tensor": -1}, strategy="tp")
    )
    # Reported in GetInfo and every ScoredGroup; "" = advertised host:port.
    sampler_id: str = ""
    # Deadline of one Score call to the reward service.
    reward_timeout_s: float = 120.0
    # On SIGTERM: how long in-flight calls may take to finish before the server exits.
    shutdown_grace_s: float = 30.0
    # Announce this sampler to the trainer at services.trainer_address (RegisterSampler, then
    # Heartbeat every services.heartbeat_s); retried quietly while the trainer is not up.
    register_with_trainer: bool = True
    # The dtype the sampler serves (None: model.dtype). "bfloat16" with float32 training: the
    # trainer keeps float32 master weights and sends bfloat16 (half the bytes).
    dtype: Literal["float32", "bfloat16"] | None = None
    # The bulk weight data plane (docs/weight-sync.md): its TCP port on services.host (0: any
    # free port; advertised in GetInfo), or None for gRPC PushWeights only.
    data_port: int | None = 0
    # A push (either transport) that sends nothing for this long is abandoned, releasing the
    # push lock; a relay declares its next sampler gone after this long without a word.
    push_idle_timeout_s: float = 30.0

    def __post_init__(self):
        _check_positive("sampler.max_batch_size", self.max_batch_size)
        _check_positive("sampler.max_sequence_length", self.max_sequence_length)
        _check_positive("sampler.max_chunk_bytes", self.max_chunk_bytes)
        _check_positive("sampler.reward_timeout_s", self.reward_timeout_s)
        _check_positive("sampler.shutdown_grace_s", self.shutdown_grace_s, allow_zero=True)
        _check_positive("sampler.data_port", self.data_port, allow_zero=True)
        if self.data_port is not None and self.data_port > 65535:
            raise ConfigError(f"sampler.data_port: expected a TCP port <= 65535, got "
                              f"{self.data_port}")
        _check_positive("sampler.push_idle_timeout_s", self.push_idle_timeout_s)


@dataclass
class AuthConfig:
    """Who may call the services (``splitrl/auth.py``; threat model in docs/security.md).

    The shared token is ``token``, else env ``token_env``, else ``token_file``. With a token set
    every RPC of every service needs it except ``open_methods``. TLS: servers serve
    ``tls_cert``/``tls_key``; clients verify them against ``tls_ca``. ``tls_client_auth`` makes
    it mutual: servers require a client certificate signed by ``tls_ca`` and every client
    channel presents ``tls_cert``/``tls_key`` (one certificate per process, valid for both).
    """

    token: str | None = None
    token_env: str = "SPLITRL_AUTH_TOKEN"
    token_file: str | None = None
    # "package.Service/Method" callable without the token. Health/Check: Kubernetes' gRPC
    # probes and `splitrl health` send no token. Trainer/Status: read-only progress.
    open_methods: list[str] = field(default_factory=lambda: [
        "grpc.health.v1.Health/Check", "splitrl.v1.Trainer/Status"])
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: bool = False
    # The name clients expect in server certificates (default: the host of the address), so
    # one certificate can serve pods whose IPs change.
    tls_server_name: str | None = None

    def __post_init__(self):
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


@dataclass
class ServicesConfig:
    """Addresses and membership. The same section drives the launcher, compose and Kubernetes."""

    host: str = "127.0.0.1"
    # The host other services use to reach this one (samplers register with it). None: ``host``
    # unless that is a wildcard (0.0.0.0), then this machine's hostname.
    advertise_host: str | None = None
    reward_address: str = "127.0.0.1:50100"
    trainer_address: str = "127.0.0.1:50200"
    sampler_port: int = 50300
    # Static sampler addresses; and/or a DNS name that resolves to many (compose, headless svc).
    sampler_addresses: list[str] = field(default_factory=list)
    sampler_dns: str | None = None
    num_samplers: int = 2
    heartbeat_s: float = 2.0
    sampler_timeout_s: float = 10.0
    metrics_port: int | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)

    def __post_init__(self):
        _check_positive("services.num_samplers", self.num_samplers, allow_zero=True)
        _check_positive("services.heartbeat_s", self.heartbeat_s)


@dataclass
class Config:
    """The whole run. Each service reads the sections it needs."""

    run_name: str = "splitrl"
    model: ModelSection = field(default_factory=ModelSection)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)

    def __post_init__(self):
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
# Strict construction from plain data


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` and build nested dataclasses."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, arg, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key}: expected a mapping for {tp.__name__}, got {type(value).__name__} {value!r}"
            )
        return from_dict(tp, value, prefix=key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value)] if args else list(
            value
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        if not args:
            return dict(value)
        return {str(k): _coerce(f"{key}.{k}", args[1], v) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected bool, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected str, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {_type_name(tp)}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise ConfigError(f"unknown key '{full}' (known: {', '.join(sorted(fields))})")
        kwargs[key] = _coerce(full, hints[key], value)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # Validators name the key relative to the section; prefix it with where the section is.
        msg = str(e)
        if prefix and not msg.startswith(prefix):
            head = prefix.rsplit(".", 1)[-1] + "."
            msg = prefix + "." + msg[len(head):] if msg.startswith(head) else f"{prefix}: {msg}"
        raise ConfigError(msg) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` -> (``"a.b.c"``, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected KEY=VALUE, e.g. trainer.steps=50")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from None
    return key, value


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = dict(data)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Load ``path`` (YAML; None = defaults) and apply ``a.b.c=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
        data = loaded
    data = merge_overrides(data, list(overrides))
    return from_dict(Config, data)


def dump_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
