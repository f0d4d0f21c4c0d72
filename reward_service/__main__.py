"""``python -m reward_service --config FILE [a.b=c ...]``: the same as ``splitrl reward``."""

from __future__ import annotations

import argparse
import sys


def _main() -> None:
    from reward_service.server import main
    from splitrl.config import load_config

    parser = argparse.ArgumentParser(prog="python -m reward_service", description=__doc__)
    parser.add_argument("--config", default=None, help="YAML config file (default: defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.workers=4")
    args = parser.parse_args()
    sys.exit(main(load_config(args.config, args.overrides)))


# Worker processes re-import the main module; only the real entry point may start a server.
if __name__ == "__main__":
    _main()
