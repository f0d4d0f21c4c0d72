"""Learning: the policy's parameters and what changes them.

Advantages and losses (pure functions, registered by name), train batches, the learner and its
optimizer, checkpoints, the multi-host hand-offs and the Hugging Face export. Nothing here
talks to a sampler or a reward service; orchestration (``trainer_service.orchestration``)
hands it batches.
"""
