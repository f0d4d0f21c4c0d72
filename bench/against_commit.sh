#!/usr/bin/env bash
# This tree against an earlier commit, interleaved: the sampler throughput modes, the real model
# and the peers' step, each commit running its own bench scripts.
#
#   bench/against_commit.sh REV [ROUNDS] [OUT_DIR]
#
# Checks REV out in a temporary git worktree and gives it a venv of its own that reuses this
# tree's installed packages (a path file: REV's sources first, then .venv's site-packages; no
# install), so the launcher's service processes and `splitrl` run REV's code. Then, ROUNDS times
# (default 1), both trees, REV first in odd rounds and this tree first in even ones (so neither
# always runs into the other's leftover load): `sampler_throughput.py` (uniform and long tail,
# synthetic model), `sampler_throughput.py` on the real model (16 prompts x 64 tokens) and
# `step_breakdown.py` on ../shared/peers, each under /usr/bin/time (wall and CPU seconds of the
# process and its children). transformers is left out (its figures do not depend on the
# commit); add SYNTH_ARGS / REAL_ARGS to change that, PEERS_ARGS for step_breakdown's config
# overrides (e.g. trainer.steps=60: a median over more steps), and PARTS to run only some of
# "synth real peers" (e.g. PARTS=peers). The peers' step of every run is printed at the end,
# one line each. Outputs land in OUT_DIR (default: a new temporary directory, printed); the
# worktree is removed at the end.
set -euo pipefail
rev=$1; rounds=${2:-1}; out=${3:-$(mktemp -d -t against-XXXX)}
here=$(cd "$(dirname "$0")/.." && pwd)
site=$("$here/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
old=$(mktemp -d -t against-tree-XXXX)/tree
git -C "$here" worktree add --detach "$old" "$rev" > /dev/null
trap 'git -C "$here" worktree remove --force "$old"; rmdir "${old%/tree}"' EXIT
python3 -m venv --without-pip "$old/.venv"
oldsite=$("$old/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$old" "$site" > "$oldsite/_against_commit.pth"
# The console script as REV's pyproject.toml names it (`splitrl = "module:function"`).
entry=$(sed -n 's/^splitrl = "\(.*\)"$/\1/p' "$old/pyproject.toml")
printf '#!%s\nimport sys\nfrom %s import %s\nsys.exit(%s())\n' "$old/.venv/bin/python" \
  "${entry%%:*}" "${entry##*:}" "${entry##*:}" > "$old/.venv/bin/splitrl"
chmod +x "$old/.venv/bin/splitrl"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 JAX_PLATFORMS=cpu TOKENIZERS_PARALLELISM=false
time_fmt='%e s wall, %U+%S s CPU'
parts=" ${PARTS:-synth real peers} "
for r in $(seq 1 "$rounds"); do
  order=("$old" "$here")
  [ $((r % 2)) = 0 ] && order=("$here" "$old")
  for tree in "${order[@]}"; do
    tag=$([ "$tree" = "$here" ] && echo this || echo "$rev")
    cd "$tree"
    py=$tree/.venv/bin/python
    echo "round $r $tag $(date -u +%T), load $(cut -d' ' -f1 /proc/loadavg)"
    if [[ $parts == *" synth "* ]]; then
      /usr/bin/time -f "$time_fmt" -o "$out/$tag-$r-synth.time" "$py" bench/sampler_throughput.py \
        --skip-real-model --skip-transformers ${SYNTH_ARGS:-} > "$out/$tag-$r-synth.txt" 2>&1
    fi
    if [[ $parts == *" real "* ]]; then
      /usr/bin/time -f "$time_fmt" -o "$out/$tag-$r-real.time" "$py" bench/sampler_throughput.py \
        --skip-uniform --skip-long-tail --prompts 16 --new-tokens 64 --skip-transformers \
        ${REAL_ARGS:-} > "$out/$tag-$r-real.txt" 2>&1
    fi
    if [[ $parts == *" peers "* ]]; then
      /usr/bin/time -f "$time_fmt" -o "$out/$tag-$r-peers.time" "$py" bench/step_breakdown.py \
        --config "$here/../shared/peers/splitrl_common.yaml" ${PEERS_ARGS:-} \
        > "$out/$tag-$r-peers.txt" 2>&1
    fi
  done
done
if [[ $parts == *" peers "* ]]; then
  for r in $(seq 1 "$rounds"); do
    for tag in "$rev" this; do
      echo "round $r $tag: $(grep -o 'load average [0-9.]*' "$out/$tag-$r-peers.txt"); $(grep -o \
        'wait [0-9.]* s.*interval [0-9.]* s' "$out/$tag-$r-peers.txt"); $(cat "$out/$tag-$r-peers.time")"
    done
  done
fi
echo "outputs in $out"
