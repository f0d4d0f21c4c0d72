"""The trainer's, the sampler's and the reward models' programs, built from a model config alone
and compiled for a target at a given batch size (`measure(rows)`).

Nothing here re-implements a program: the trainer's are `Learner.lower_train_step` of a
learner over abstract parameters, the sampler's are `Scheduler.lower` (prefill, admit, decode)
of the engine `sampler_service.engine.engine_from_config` builds, the same factory the sampler
server builds its engine with. Shapes are the worst case a run allows: the trainer's
micro-batch at the longest sequence the samplers accept (`sampler.max_sequence_length`,
bucketed as `learning.batching` buckets), the sampler's full batch (`sampler.max_batch_size`
rows, groups of `algorithm.group_size`) with the longest prompt that still leaves room for
`sampling.max_new_tokens`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from splitrl.config import Config, RewardModelConfig
from splitrl.mesh import DATA_AXIS, FSDP_AXIS, build_mesh
from splitrl.models import TransformerConfig, abstract_model, param_shapes, state_from_hf
from splitrl_app.planning.memory import Measurement, OutOfMemory, compile_program, shard_bytes
from splitrl_app.planning.targets import Target


def _measure(rows: int, capacity: int, lowered: dict, categories) -> Measurement:
    """Compiles `lowered` ({name: Lowered}) and fills in the categories from the results."""
    programs = []
    try:
        for name, low in lowered.items():
            programs.append(compile_program(name, low))
    except OutOfMemory as e:
        return Measurement(rows, {}, programs, capacity, error=str(e), needed=e.needed)
    return Measurement(rows, categories({p.name: p for p in programs}), programs, capacity)


class TrainerPlanner:
    """The trainer's train step (forward, backward, accumulation; the optax update)."""

    service = "trainer"
    unit = "micro-batch rows"

    def __init__(self, cfg: Config, model_config: TransformerConfig, target: Target):
        from trainer_service.learning.batching import bucket
        from trainer_service.learning.learner import Learner

        self.target = target
        self.mesh = build_mesh(cfg.trainer.mesh, target.devices)
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.learner = Learner.from_config(abstract_model(model_config, self.dtype), cfg,
                                           self.mesh)
        self.batch = cfg.trainer.prompts_per_step * cfg.algorithm.group_size
        self.rows = min(cfg.trainer.micro_batch_size or self.batch, self.batch)
        self.length = bucket(cfg.sampler.max_sequence_length)
        self.step = math.prod(self.mesh.shape[a] for a in (DATA_AXIS, FSDP_AXIS)
                              if a in self.mesh.axis_names)
        self.limit = self.batch
        self.beta = cfg.algorithm.beta
        self.strategy = cfg.trainer.mesh.strategy

    def describe(self, rows: int) -> str:
        n = math.ceil(self.batch / rows)
        return (f"micro-batch {rows} rows x {self.length} tokens (batch {self.batch} rows = {n} "
                f"micro-batch{'es' if n > 1 else ''}), {self.dtype.name}, "
                f"strategy {self.strategy}")

    def held(self, rows: int) -> dict[str, int]:
        """Bytes per device the trainer keeps between programs (from the arrays' shardings,
        no compile): parameters, optimizer state, gradient accumulator, the step's batch."""
        learner = self.learner
        params = shard_bytes(learner.params)
        ways = self.step if rows % self.step == 0 else 1
        # Per micro-batch: tokens int32, two bool masks, sampler logprobs f32, advantages;
        # kept for the step: pi_old logprobs (and reference logprobs when beta > 0).
        per_row = self.length * (4 + 1 + 1 + 4) + 4 + (self.length - 1) * 4 * (
            2 if self.beta > 0 else 1)
        out = {
            "parameters": params,
            "optimizer state": shard_bytes(learner.opt_state),
            "gradients": params,  # the accumulator: same shapes and shardings
            "batch": math.ceil(self.batch / rows) * rows * per_row // ways,
        }
        if learner.base_params is not None:  # LoRA: "parameters" are the adapters
            out["base parameters"] = shard_bytes(learner.base_params)
        if learner.ref_params is not None:
            out["reference parameters"] = shard_bytes(learner.ref_params)
        return out

    def measure(self, rows: int) -> Measurement:
        def categories(programs):
            return {**self.held(rows),
                    "temporaries": max(p.transient for p in programs.values())}

        return _measure(rows, self.target.hbm_bytes,
                        self.learner.lower_train_step(rows, self.length), categories)


class SamplerPlanner:
    """The sampler engine's programs (`sampler_service.scheduler.Scheduler.lower`): a packed
    prefill of a full batch of prompts, their admission into the KV cache, a decode segment
    over the cache at its widest."""

    service = "sampler"
    unit = "sequences in flight"

    def __init__(self, cfg: Config, model_config: TransformerConfig, target: Target):
        from flax import nnx

        from sampler_service.engine import serving_dtype
        from sampler_service.sampling import SamplingOptions

        sampler, sampling = cfg.sampler, cfg.sampling
        self.cfg = cfg
        self.target = target
        self.config = model_config
        self.dtype = serving_dtype(cfg)
        self.mesh = build_mesh(sampler.mesh, target.devices)
        self.graphdef = nnx.split(abstract_model(model_config, self.dtype))[0]
        eos = model_config.eos_token_id
        self.eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.group = min(cfg.algorithm.group_size, sampler.max_batch_size)
        self.prompt_length = max(1, sampler.max_sequence_length - sampling.max_new_tokens)
        self.new_tokens = sampling.max_new_tokens
        self.options = SamplingOptions(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=tuple(sampling.stop_token_ids))
        self.engine = self._engine(sampler.max_batch_size, sampler.kv_cache_bytes,
                                   sampler.kv_pages)
        shardings = self.engine.state_shardings(sampler.mesh.strategy)
        self.state = state_from_hf(model_config, {
            name: jax.ShapeDtypeStruct(s.shape, self.dtype, sharding=shardings[name])
            for name, s in param_shapes(model_config).items()})
        # The configured engine's rows: max_batch_size, or fewer when kv_cache_bytes (or
        # kv_pages) is set.
        self.rows = self.engine.max_batch_size
        self.step = self.group
        self.limit = 16 * max(self.rows, self.group)
        self.strategy = sampler.mesh.strategy
        self.budget = (f"kv_cache_bytes {sampler.kv_cache_bytes}" if sampler.kv_cache_bytes
                       else f"kv_pages {sampler.kv_pages}" if sampler.kv_pages
                       and self.engine.cache.paged else None)

    def _engine(self, rows: int, kv_cache_bytes: int, kv_pages: int):
        from sampler_service.engine import engine_from_config

        return engine_from_config(self.cfg, self.config, self.graphdef, self.mesh,
                                  eos_token_ids=self.eos, pad_token_id=0, max_batch_size=rows,
                                  kv_cache_bytes=kv_cache_bytes, kv_pages=kv_pages)

    def describe(self, rows: int) -> str:
        sized = "KV page pool" if self.engine.cache.paged else "KV cache"
        budget = (self.budget if rows == self.rows and self.budget
                  else f"{sized} sized for them")
        return (f"{rows} sequences in flight ({rows // self.group} prompts x {self.group}), "
                f"prompt {self.prompt_length} + {self.new_tokens} new tokens, {budget}, "
                f"{self.dtype.name}, strategy {self.strategy}")

    def measure(self, rows: int) -> Measurement:
        from sampler_service.requests import PinnedWeights

        params = shard_bytes(self.state)
        # The configured engine at its own rows; a searched size gets a cache sized for it.
        engine = self.engine if rows == self.rows else self._engine(rows, 0, 0)
        prompts = [[0] * self.prompt_length] * max(1, rows // self.group)
        request = engine.new_request(prompts, self.options, min(self.group, rows),
                                     weights=PinnedWeights(0, self.state))
        lowered, cache = engine.scheduler.lower(request)
        # Every batch may hold a full cache at once (sampler.concurrent_batches).
        kv = shard_bytes(cache) * len(engine.schedulers)

        def categories(programs):
            prefill, admit, decode = (programs[k] for k in ("prefill", "admit", "decode"))
            out = {
                "parameters": params,
                "push staging": params,  # a push is staged beside the served weights
                "kv cache": kv,
                # a resize copies one array at a time: the keys (or the values) held twice
                "kv cache resize": kv // engine.cache.num_arrays,
                # prefill's keys/values and hidden states live on into the admit program
                "temporaries": max(prefill.transient, prefill.new_outputs + admit.transient,
                                   decode.transient),
            }
            if engine.cache.paged:  # a page pool is allocated once, never resized
                del out["kv cache resize"]
            return out

        return _measure(rows, self.target.hbm_bytes, lowered, categories)


class RewardModelPlanner:
    """A reward model's forward (`reward_service.reward_models.label_scores`) on the reward
    service's mesh (`reward.mesh`): the longest input bucket `max_length` allows, at the rows
    `max_batch_tokens` gives it (every forward at one length has one shape)."""

    service = "reward"
    unit = "sequences per forward"

    def __init__(self, cfg: Config, model: RewardModelConfig, target: Target):
        from flax import nnx

        from reward_service.reward_models import longest_forward
        from splitrl.mesh import param_shardings
        from splitrl.models.sequence_classifier import abstract_classifier, load_classifier_config

        self.model = model
        self.target = target
        self.mesh = build_mesh(cfg.reward.mesh, target.devices)
        self.dtype = jnp.dtype(model.dtype)
        config = load_classifier_config(model.path)
        self.graphdef, abstract = nnx.split(abstract_classifier(config, self.dtype))
        shardings = param_shardings(self.mesh, param_shapes(config.decoder),
                                    cfg.reward.mesh.strategy)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        leaves = []  # the decoder laid out as the service lays it out; the small head replicated
        for path, var in nnx.to_flat_state(abstract):
            name = ".".join(str(p) for p in path[1:]) if path[0] == "backbone" else ""
            leaves.append((path, var.replace(jax.ShapeDtypeStruct(
                var.get_value().shape, self.dtype,
                sharding=shardings.get(name, replicated)))))
        self.state = nnx.from_flat_state(leaves)
        self.inputs = replicated
        self.rows, self.length = longest_forward(model)
        self.step = 1
        self.limit = 16 * self.rows
        self.strategy = cfg.reward.mesh.strategy

    def describe(self, rows: int) -> str:
        return (f"reward model {self.model.name!r}: {rows} sequences x {self.length} tokens "
                f"(max_batch_tokens {rows * self.length}, max_length {self.model.max_length}),"
                f" {self.dtype.name}, strategy {self.strategy}")

    def measure(self, rows: int) -> Measurement:
        import functools

        from reward_service.reward_models import label_scores

        forward = jax.jit(functools.partial(label_scores, label=self.model.label),
                          static_argnums=0)
        tokens = jax.ShapeDtypeStruct((rows, self.length), jnp.int32, sharding=self.inputs)
        lengths = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self.inputs)
        lowered = {"score": forward.lower(self.graphdef, self.state, tokens, lengths)}

        def categories(programs):
            return {"parameters": shard_bytes(self.state),
                    "temporaries": programs["score"].transient}

        return _measure(rows, self.target.hbm_bytes, lowered, categories)
