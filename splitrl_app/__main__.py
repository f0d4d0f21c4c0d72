"""``python -m splitrl_app``: the ``splitrl`` executable (the launcher starts every service
this way)."""

from splitrl_app.cli import entry

entry()
