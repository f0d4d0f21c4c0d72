"""How `make test` hands test modules to its two pytest-xdist workers (``--dist loadscope
--no-loadscope-reorder``: a module's tests on one worker, in file order, modules in the order
``order_modules`` gives).

Two things xdist's defaults cost the suite, fixed here:

- loadscope queues modules by their number of tests, most first, so the multi-process modules
  (marked ``slow``: a few tests, each a run of minutes) came last and the suite ended with one
  worker on the last long run and the other idle. They are queued first now, and the many
  short modules after them keep both workers busy to the end.
- Modules that share a session fixture starting service processes (tests/security's reward,
  sampler and trainer; the reward server of two reward_service modules) could land on both
  workers, and each worker started the services. Each such group is one unit of work now.
"""

from __future__ import annotations

from collections import Counter

import pytest
from xdist.scheduler import LoadScopeScheduling

# Groups of modules (path prefixes) that share a session fixture starting service processes.
SHARED_SERVICE_GROUPS = (
    ("tests/security/",),  # `services`: reward, sampler and trainer
    ("tests/reward_service/test_reward_conventions.py",  # `reward_server`
     "tests/reward_service/test_reward_server.py"),
)


class SuiteScheduling(LoadScopeScheduling):
    """loadscope, with each group of ``SHARED_SERVICE_GROUPS`` one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        for group in SHARED_SERVICE_GROUPS:
            if nodeid.startswith(group):
                return group[0]
        return super()._split_scope(nodeid)


def order_modules(items: list[pytest.Item]) -> None:
    """Sorts ``items`` in place: the modules with a ``slow`` test first, then the others with
    the most tests first (loadscope's own order); a module's tests stay in file order."""
    module = {id(item): item.nodeid.split("::", 1)[0] for item in items}
    counts = Counter(module.values())
    slow = {module[id(item)] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (module[id(item)] not in slow, -counts[module[id(item)]]))
