"""Settings of the reward server that the gRPC tests start (shared by conftest and tests)."""

from __future__ import annotations

TIMEOUT_S = 2.0  # reward.timeout_s of the test server
KILL_GRACE_S = 0.5
USER_TIMEOUT_S = 1.0  # the misbehaving user functions get a shorter limit
# hang_when_asked's limit: long enough that whatever else a test does while it hangs finishes
# first, however busy the machine.
HANG_TIMEOUT_S = 10.0
MARKER = "hang-marker"  # its marker file, in the server's temporary directory
MAX_ITEMS = 64
MAX_REQUEST_BYTES = 4 * 1024 * 1024

P = "pathological_rewards:"
PUB = "published_rewards:"
# Published reward functions (TRL's guide, EasyDeL's tutorial) and helpers of the calling
# convention tests; weight 0 so that they leave the totals of the other tests alone.
CONVENTION_FUNCTIONS = [
    PUB + "trl_reward_token_count", PUB + "trl_reward_char_count", PUB + "trl_format_reward_func",
    PUB + "trl_reward_ground_truth", PUB + "trl_math_reward_func", PUB + "trl_coding_reward_func",
    PUB + "trl_async_reward_func", PUB + "format_reward", PUB + "accuracy_reward",
    P + "batch_size", P + "typed_columns", P + "wrong_length",
]
SERVER_CONFIG = {
    "run_name": "reward-tests",
    "reward": {
        "workers": 2,
        "timeout_s": TIMEOUT_S,
        "kill_grace_s": KILL_GRACE_S,
        "max_items_per_request": MAX_ITEMS,
        "max_request_bytes": MAX_REQUEST_BYTES,
        "functions": [
            {"name": "math_accuracy", "weight": 1.0},
            {"name": "format", "weight": 0.5},
            {"name": "length", "weight": 1.0, "options": {"max_tokens": 100, "buffer": 20}},
            {"name": "exact_answer", "weight": 1.0},
            {"name": P + "sleep_forever", "timeout_s": USER_TIMEOUT_S},
            {"name": P + "hang_ignoring_alarm", "timeout_s": USER_TIMEOUT_S},
            {"name": P + "raise_error"},
            {"name": P + "return_nan"},
            {"name": P + "exit_process"},
            {"name": P + "hang_when_asked", "weight": 0.0, "timeout_s": HANG_TIMEOUT_S,
             "options": {"marker": MARKER}},
            *({"name": name, "weight": 0.0} for name in CONVENTION_FUNCTIONS),
        ],
    },
}
