#!/usr/bin/env bash
# `make demo` as a new machine sees it: a fresh clone of this checkout's HEAD, no .venv,
# an empty uv cache, an empty looprl model cache (the GGUF converted again). Every line
# is prefixed with the seconds since `make demo` started; at the end: the seconds to
# the install's end, the first log line, the "Training ..." line and the first eval,
# and the finished run directory's size by part.
#
#     bash bench/fresh_demo.sh [DIR] [--until-training]
#
# --until-training stops the run at its "Training ..." line (the start-up figures only).
set -u
dir=${1:-/tmp/looprl-fresh-demo}
until_training=${2:-}
rm -rf "$dir" && mkdir -p "$dir"
git clone -q "$(git rev-parse --show-toplevel)" "$dir/clone" && cd "$dir/clone" || exit 1
export UV_CACHE_DIR="$dir/uv-cache" LOOPRL_CACHE="$dir/looprl-cache" PIP_NO_CACHE_DIR=1
start=$(date +%s.%N)
make demo 2>&1 | python3 -u -c '
import os, sys, time
start, until_training, log = float(sys.argv[1]), sys.argv[2] == "--until-training", sys.argv[3]
marks = {}
with open(log, "w") as out:
    for line in sys.stdin:
        t = time.time() - start
        out.write(f"{t:7.1f} {line}")
        if "de-quantizing" in line:  # a progress bar redrawn in place
            continue
        print(f"{t:7.1f} {line}", end="", flush=True)
        for mark, text in (("install", "looprl train"), ("first log line", " INFO "),
                           ("training line", "INFO     Training "), ("first eval", "eval at step 0")):
            if text in line and mark not in marks:
                marks[mark] = t
        if until_training and "training line" in marks:
            os.system("pkill -INT -f \"looprl train recover.mode=off\"")
            break
print("seconds from `make demo`: " + ", ".join(f"{k} {v:.1f}" for k, v in marks.items()))
' "$start" "$until_training" "$dir/demo.log"
[ -n "$until_training" ] && exit 0
echo "run directory:"; du -sh runs/default/trial0; du -sh runs/default/trial0/* | sort -h
