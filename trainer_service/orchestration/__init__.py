"""Orchestration: which prompts go where and when.

The data stream, sampler membership, dispatch of rollouts, the rollout buffer, weight
publishing and evaluation runs. Nothing here computes a gradient; the learning side
(``trainer_service.learning``) never talks to another service.
"""
