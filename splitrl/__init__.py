"""SplitRL: disaggregated GRPO/GSPO post-training in JAX.

The shared core lives here: config, models, Hugging Face checkpoint io, tokenizer, mesh and
partition rules, the tensor wire format and the CLI. Services (``sampler_service``,
``reward_service``, ``trainer_service``) import from this package, never from each other.
"""

__version__ = "0.1.0"
