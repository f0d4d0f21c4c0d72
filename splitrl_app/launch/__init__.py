"""The local launcher (``splitrl up``, ``splitrl demo``), one module per concern:

- ``up``: the command: preflight, start, watch, stop, the closing report;
- ``preflight``: what stops a run before any service starts (model, data, resume, trackers,
  memory);
- ``supervisor``: the services' processes (start, health, exit reports, stop) with ``ports``,
  ``oom`` (an OOM kill told apart) and ``service_logs`` (error lines of the services' logs);
- ``console``: the progress bar, the phase lines, errors as they are written;
- ``demo``: the built-in tiny run.
"""
