"""``python -m sampler_service --config FILE [a.b=c ...]``: same as ``splitrl sampler``."""

from __future__ import annotations

import argparse
import os
import sys

from splitrl.config import ConfigError, load_config


def cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sampler_service",
                                     description="Run a SplitRL sampler service.")
    parser.add_argument("--config", default=os.environ.get("SPLITRL_CONFIG"),
                        help="YAML config file (default: $SPLITRL_CONFIG, else defaults)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. sampler.max_batch_size=64")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"sampler: config error: {e}", file=sys.stderr)
        return 2
    from sampler_service.server import main

    return main(config)


if __name__ == "__main__":
    code = cli()
    from splitrl.serving import exit_without_teardown

    # As `splitrl sampler`: the sampler has stopped its servers and engine when cli() returns.
    exit_without_teardown(code)
