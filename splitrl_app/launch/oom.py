"""Was a service that died of SIGKILL killed by the kernel's OOM killer? (`splitrl up` says so.)

A process the OOM killer ends exits like any other SIGKILL (code -9), and its log stops
mid-line with nothing in it to say why. What can be known, and from where:

- the kernel log (``/dev/kmsg``: readable by root, or by anyone where
  ``kernel.dmesg_restrict=0``) names the pid it killed: ``Out of memory: Killed process 1234
  (python)`` or ``Memory cgroup out of memory: Killed process 1234 ...``. Certain, while the
  line is still in the kernel's ring buffer (and when the launcher sees the pids the kernel
  does: not from inside a pid namespace of its own, where the counter below still answers);
- the memory cgroup's count of OOM kills (v2 ``memory.events`` ``oom_kill``, which counts the
  cgroup's descendants too; v1 ``memory.oom_control`` ``oom_kill``), compared with its value
  when the launch started: a kill in this cgroup while the service ran, of some process, so
  very likely the service that died of SIGKILL then, but not certain;
- neither readable (a container without access to the kernel log and no cgroup files): not
  knowable from here. The report then says the OOM killer is the usual cause of a SIGKILL
  nobody sent, and how to check (``dmesg``).

A SIGKILL from a person or another program (``kill -9``, ``docker kill``, an eviction) leaves
no such record, and is reported as a SIGKILL that was not the OOM killer's when the records
are readable.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from splitrl_app.planning.estimate import memory_cgroup_files

_KILLED = re.compile(r"Killed process (\d+)\b")
_COUNTER = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)

OOM_KILLED = "killed by the OOM killer (out of memory)"


class OomWitness:
    """The kernel's records of OOM kills, read when a service died of SIGKILL. Made when the
    launch starts, so the cgroup's count has a baseline to compare with."""

    def __init__(self, kernel_log: str | os.PathLike = "/dev/kmsg",
                 counters: list[Path] | None = None):
        self.kernel_log = Path(kernel_log)
        self.counters = (memory_cgroup_files("memory.events", "memory.oom_control")
                         if counters is None else counters)
        self.baseline = self.oom_kills()

    def oom_kills(self) -> int | None:
        """OOM kills the readable cgroup counters have counted, or None if none is readable."""
        total = None
        for path in self.counters:
            try:
                found = _COUNTER.search(path.read_text())
            except OSError:
                continue
            if found:
                total = (total or 0) + int(found.group(1))
        return total

    def killed_pids(self) -> set[int] | None:
        """The pids the kernel log says the OOM killer killed, or None if it is not readable.
        ``/dev/kmsg`` gives one record per read and is read without blocking to its end."""
        try:
            fd = os.open(self.kernel_log, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        chunks = []
        try:
            while True:
                try:
                    chunk = os.read(fd, 8192)
                except BlockingIOError:  # the end of the ring buffer
                    break
                except OSError:  # EPIPE: a record was overwritten while reading; go on
                    continue
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
        text = b"".join(chunks).decode("utf-8", "replace")
        return {int(pid) for pid in _KILLED.findall(text)}

    def verdict(self, pid: int) -> Verdict:
        """Why process ``pid``, dead of SIGKILL, died."""
        pids = self.killed_pids()
        if pids is not None and pid in pids:
            return Verdict(True, f"{OOM_KILLED}: the kernel log says so for pid {pid}")
        kills = self.oom_kills()
        if kills is not None and self.baseline is not None and kills > self.baseline:
            return Verdict(True, f"{OOM_KILLED}: its memory cgroup counted "
                                 f"{kills - self.baseline} OOM kill(s) while the launch ran")
        if pids is not None or kills is not None:
            return Verdict(False, "killed by SIGKILL, not by the OOM killer (the kernel's "
                                  "records show no such kill): something sent it kill -9")
        return Verdict(None, "killed by SIGKILL: most often the kernel's OOM killer (out of "
                             "memory); the kernel log and the cgroup's counters are not "
                             "readable here to confirm it (`dmesg | grep -i 'killed process'` "
                             "on the host shows it)")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``oom``: True (the kernel's records say so), False (they say not), None (unreadable)."""

    oom: bool | None
    text: str
