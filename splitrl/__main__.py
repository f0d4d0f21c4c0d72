"""``python -m splitrl``: the same entry as the ``splitrl`` executable. The command lives in the
application layer (``splitrl_app.cli``); this module is only an entry point, which nothing in
the core imports (the import contract in pyproject.toml names it as the one exception)."""

from splitrl_app.cli import entry

entry()
