"""How `make test` hands test modules to its two pytest-xdist workers (``--dist loadscope
--no-loadscope-reorder``: a module's tests on one worker, in file order, modules in the order
``order_modules`` gives).

Two things xdist's defaults cost the suite, fixed here:

- loadscope queues modules by their number of tests, most first, so the multi-process modules
  (marked ``slow``: a few tests, each a run of minutes) came last and the suite ended with one
  worker on the last long run and the other idle. They are queued first now, and the many
  short modules after them keep both workers busy to the end.
- The modules of tests/security share a session fixture that starts reward, sampler and
  trainer processes; when they landed on both workers, each worker started the services.
  Such a folder is one unit of work now.
"""

from __future__ import annotations

from collections import Counter

import pytest
from xdist.scheduler import LoadScopeScheduling

# Folders whose modules share a session fixture that starts service processes.
SHARED_SERVICE_FOLDERS = ("tests/security/",)


class SuiteScheduling(LoadScopeScheduling):
    """loadscope, with each folder of ``SHARED_SERVICE_FOLDERS`` one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        for folder in SHARED_SERVICE_FOLDERS:
            if nodeid.startswith(folder):
                return folder
        return super()._split_scope(nodeid)


def order_modules(items: list[pytest.Item]) -> None:
    """Sorts ``items`` in place: the modules with a ``slow`` test first, then the others with
    the most tests first (loadscope's own order); a module's tests stay in file order."""
    module = {id(item): item.nodeid.split("::", 1)[0] for item in items}
    counts = Counter(module.values())
    slow = {module[id(item)] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (module[id(item)] not in slow, -counts[module[id(item)]]))
