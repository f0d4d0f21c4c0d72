"""``python -m splitrl``: the same entry as the ``splitrl`` executable (the launcher starts
every service this way)."""

from splitrl.cli import entry

entry()
