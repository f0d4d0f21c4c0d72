"""SplitRL's application layer: the ``splitrl`` command and what only it needs.

The CLI, the local launcher (``splitrl up`` / ``demo``: it starts and supervises all three
services), ``splitrl eval``, ``splitrl plan`` (compiling the services' programs for a target),
the Kubernetes helpers and a run's plots. Layers (DESIGN.md principle 11, held by
tests/test_layers.py): the core ``splitrl`` imports no service; ``sampler_service``,
``reward_service`` and ``trainer_service`` import the core and never each other; this package
may import all of them, and nothing below imports it.
"""
