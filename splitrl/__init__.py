"""SplitRL: disaggregated GRPO/GSPO post-training in JAX.

The shared core lives here: config, models, Hugging Face checkpoint io, tokenizer, mesh and
partition rules, the tensor wire format and data plane, serving helpers and tasks. It imports no
service. Services (``sampler_service``, ``reward_service``, ``trainer_service``) import from
this package, never from each other; the ``splitrl`` command, the launcher and the planner are
the application layer above them all (``splitrl_app``).
"""

__version__ = "0.1.0"
