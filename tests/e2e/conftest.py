"""Fixtures for the end-to-end runs (the demo's tiny model, ``arith_model``, is in
tests/conftest.py: unit tests use it too)."""

from __future__ import annotations

import pytest

from splitrl.init_model import init_model


@pytest.fixture(scope="session")
def gsm8k_model(tmp_path_factory, shared_data):
    """A tiny Qwen2 with the default byte-level vocabulary (arithmetic + GSM8K text)."""
    return init_model(tmp_path_factory.mktemp("models") / "tiny-default", family="qwen2",
                      preset="tiny", vocab="default", seed=0)
