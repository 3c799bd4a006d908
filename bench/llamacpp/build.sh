#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-server and llama-quantize, a third-party project (MIT),
# OUTSIDE this repository, and makes the Q8_0 GGUF the comparisons use. Nothing of llama.cpp
# (source, build, binaries) or of the models is committed here: only this script and the
# scripts that drive the binaries (compare-kernels.sh, compare-serving.sh).
#
# Source: the llama.cpp tree vendored in a PyPI sdist (this machine reaches PyPI but not GitHub):
#   - llama-cpp-python 0.3.36 (the default) vendors llama.cpp commit 0c1e57098, the build
#     ../shared/anchors.md quotes. It has no Qwen3-Next or Qwen3.5.
#   - xllamacpp 2026.10.11549 (LLAMA_PACKAGE=xllamacpp) vendors a llama.cpp of October 2026 that
#     has them (src/models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp): the hybrid comparisons use it.
#
# Idempotent: every step is skipped when its output exists (set LLAMA_REBUILD=1 to rebuild).
#
#   LLAMA_PACKAGE             llama-cpp-python (default) or xllamacpp
#   LLAMA_CPP_PYTHON_VERSION  sdist version (default 0.3.36, or 2026.10.11549 for xllamacpp;
#                             the sha256 of each default is checked)
#   LLAMA_SRC                 where the sdist is downloaded and unpacked (default /opt/llama-src)
#   LLAMA_BUILD               CMake build directory; binaries in $LLAMA_BUILD/bin (default /opt/llama.cpp-build)
#   LLAMA_MODELS              where the Q8_0 GGUF is written (default /opt/models)
#   BATON_HOME                Baton's cache; the Q4_1 source GGUF is $BATON_HOME/models/... (default ~/.cache/baton)
#   JOBS                      build parallelism (default 2; the build runs under `nice -n 10`)
#   LLAMA_CMAKE_ARGS          extra CMake arguments, appended last
#
# CPU flags: -march=native minus AMX. The VMs this project runs on list AMX in /proc/cpuinfo,
# and on some of them AMX instructions trap (SIGILL), so AMX is disabled explicitly: the GGML_AMX_*
# options only act with GGML_NATIVE=OFF, so -mno-amx-* is also passed in the compiler flags
# (explicit -mno-* wins over what -march=native implies, whatever the order).
set -euo pipefail

PACKAGE=${LLAMA_PACKAGE:-llama-cpp-python}
case "$PACKAGE" in
    llama-cpp-python)
        VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
        DEFAULT_VERSION=0.3.36
        DEFAULT_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
        UNPACKED=llama_cpp_python-$VERSION
        SUBDIR=vendor/llama.cpp ;;
    xllamacpp)
        VERSION=${LLAMA_CPP_PYTHON_VERSION:-2026.10.11549}
        DEFAULT_VERSION=2026.10.11549
        DEFAULT_SHA256=c17ee1163006f70726abb9f72137830818f3d8cb60bfc34cb232d08428eaa22b
        UNPACKED=xllamacpp-$VERSION
        SUBDIR=thirdparty/llama.cpp ;;
    *) echo "[llamacpp/build] error: LLAMA_PACKAGE must be llama-cpp-python or xllamacpp, not '$PACKAGE'" >&2; exit 1 ;;
esac
LLAMA_SRC=${LLAMA_SRC:-/opt/llama-src}
LLAMA_BUILD=${LLAMA_BUILD:-/opt/llama.cpp-build}
LLAMA_MODELS=${LLAMA_MODELS:-/opt/models}
JOBS=${JOBS:-2}
BATON_HOME=${BATON_HOME:-$HOME/.cache/baton}
Q4_1="$BATON_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf"
Q8="$LLAMA_MODELS/SmolLM2-135M-Instruct.Q8_0.gguf"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TARGETS=(llama-bench llama-server llama-quantize)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

log() { echo "[llamacpp/build] $*" >&2; }
die() { echo "[llamacpp/build] error: $*" >&2; exit 1; }

for tool in cmake python3 tar sha256sum cc c++; do
    command -v "$tool" >/dev/null || die "$tool not found (cmake: apt-get install -y cmake)"
done
case "$(uname -m)" in x86_64) ;; *) NO_AMX="" ;; esac

# 1. sdist from PyPI, unpacked.
SDIST="$LLAMA_SRC/$UNPACKED.tar.gz"
TREE="$LLAMA_SRC/$UNPACKED/$SUBDIR"
mkdir -p "$LLAMA_SRC"
if [[ ! -f "$SDIST" ]]; then
    log "downloading $PACKAGE==$VERSION (sdist) into $LLAMA_SRC"
    # --no-binary for this package only: its build dependencies (used by pip to read the sdist's
    # metadata) may come as wheels.
    python3 -m pip download --quiet --no-deps --no-binary "$PACKAGE" \
        "$PACKAGE==$VERSION" -d "$LLAMA_SRC"
fi
[[ -f "$SDIST" ]] || die "pip did not produce $SDIST"
if [[ "$VERSION" == "$DEFAULT_VERSION" ]]; then
    echo "$DEFAULT_SHA256  $SDIST" | sha256sum --check --quiet - || die "sha256 mismatch for $SDIST"
fi
if [[ ! -f "$TREE/CMakeLists.txt" ]]; then
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$LLAMA_SRC"
fi
[[ -f "$TREE/CMakeLists.txt" ]] || die "no vendor/llama.cpp in $SDIST"
grep -m1 'update llama.cpp to' "$LLAMA_SRC/$UNPACKED/CHANGELOG.md" 2>/dev/null | sed 's/^- */[llamacpp\/build] vendored: /' >&2 || true

# 2. Configure and build the three tools (static libraries: the binaries are self-contained).
have_bins() { for t in "${TARGETS[@]}"; do [[ -x "$LLAMA_BUILD/bin/$t" ]] || return 1; done; }
if [[ "${LLAMA_REBUILD:-0}" == 1 ]] || ! have_bins; then
    if [[ "${LLAMA_REBUILD:-0}" == 1 ]] || [[ ! -f "$LLAMA_BUILD/CMakeCache.txt" ]]; then
        log "configuring $TREE -> $LLAMA_BUILD"
        # shellcheck disable=SC2086  # LLAMA_CMAKE_ARGS is a word list on purpose
        cmake -S "$TREE" -B "$LLAMA_BUILD" \
            -DCMAKE_BUILD_TYPE=Release \
            -DBUILD_SHARED_LIBS=OFF \
            -DGGML_NATIVE=ON \
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
            "-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX" \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_OPENSSL=OFF \
            ${LLAMA_CMAKE_ARGS:-}
    fi
    log "building ${TARGETS[*]} (-j$JOBS, nice 10)"
    nice -n 10 cmake --build "$LLAMA_BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"
fi
have_bins || die "build finished without ${TARGETS[*]} in $LLAMA_BUILD/bin"

# 3. Q8_0 GGUF, re-quantized from Baton's default Q4_1 file (the same weights Baton's
#    `--weights q8_0` re-quantizes at load).
if [[ ! -f "$Q4_1" ]]; then
    BATON=""
    for b in "$REPO/target/release/baton" "$REPO/target/debug/baton"; do
        [[ -x "$b" ]] && { BATON=$b; break; }
    done
    [[ -n "$BATON" ]] || die "$Q4_1 missing and no baton binary to fetch it (cargo build --release -p baton-coordinator)"
    log "fetching the model with $BATON fetch"
    BATON_HOME="$BATON_HOME" "$BATON" fetch
fi
[[ -f "$Q4_1" ]] || die "$Q4_1 still missing"
mkdir -p "$LLAMA_MODELS"
if [[ ! -f "$Q8" ]]; then
    log "quantizing $Q4_1 -> $Q8"
    "$LLAMA_BUILD/bin/llama-quantize" --allow-requantize "$Q4_1" "$Q8.tmp" Q8_0 >"$Q8.log" 2>&1 \
        || { tail -20 "$Q8.log" >&2; die "llama-quantize failed (log: $Q8.log)"; }
    mv "$Q8.tmp" "$Q8"
fi

# 4. A few-second check that the binaries run on this CPU (an illegal instruction shows here).
log "checking llama-bench on $Q8"
"$LLAMA_BUILD/bin/llama-bench" -m "$Q8" -p 8 -n 4 -t 1 -r 1 -o md >&2 \
    || die "llama-bench failed (exit $?; 132 = SIGILL: rebuild with LLAMA_REBUILD=1 and -DGGML_NATIVE=OFF plus explicit -DGGML_AVX512=ON ... in LLAMA_CMAKE_ARGS)"

cat <<EOF
LLAMA_BUILD=$LLAMA_BUILD
LLAMA_BENCH=$LLAMA_BUILD/bin/llama-bench
LLAMA_SERVER=$LLAMA_BUILD/bin/llama-server
LLAMA_QUANTIZE=$LLAMA_BUILD/bin/llama-quantize
Q8_0_GGUF=$Q8
EOF
