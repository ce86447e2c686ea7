#!/usr/bin/env bash
# Builds and runs a libFuzzer target with clang, -fsanitize=fuzzer,address,
# undefined, in its own build directory (build-fuzz/, or $FORESHOCK_FUZZ_BUILD):
# FORESHOCK_FUZZ_TARGET=request (default) fuzzes request decoding and
# validation (request_fuzzer.cc, seeded from tests/fuzz/corpus);
# FORESHOCK_FUZZ_TARGET=store_recovery fuzzes the store's recovery from
# mutated segment files (store_recovery_fuzzer.cc, which mutates a segment it
# writes itself).
#
#   tests/fuzz/run.sh build              # build only
#   tests/fuzz/run.sh smoke [RUNS]       # the corpus, then RUNS more executions (default
#                                        # 300000); what ctest runs (fuzz_request_smoke)
#   tests/fuzz/run.sh fuzz [LIBFUZZER ARGS...]   # open-ended fuzzing, new inputs kept in
#                                        # build-fuzz/corpus (seeded from tests/fuzz/corpus)
#
# Needs Debian's clang with libFuzzer and the sanitizer runtimes: packages
# clang and libclang-rt-14-dev (only a recommendation of clang, so
# --no-install-recommends leaves it out), plus protoc (protobuf-compiler) and
# the protobuf/abseil development packages the main build uses.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="${FORESHOCK_FUZZ_BUILD:-$ROOT/build-fuzz}"
CXX="${FORESHOCK_FUZZ_CXX:-clang++}"
TARGET="${FORESHOCK_FUZZ_TARGET:-request}"
BIN="$BUILD/${TARGET}_fuzzer"

if ! command -v "$CXX" >/dev/null 2>&1; then
  echo "tests/fuzz/run.sh: $CXX not found; the fuzz target needs clang with libFuzzer" \
       "(Debian: apt-get install -y --no-install-recommends clang libclang-rt-14-dev)" >&2
  exit 1
fi
fuzzer_lib="$("$CXX" -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null || true)"
if [[ "$fuzzer_lib" != /* || ! -f "$fuzzer_lib" ]]; then
  echo "tests/fuzz/run.sh: $CXX has no libFuzzer runtime (Debian: apt-get install -y" \
       "--no-install-recommends libclang-rt-14-dev)" >&2
  exit 1
fi
command -v protoc >/dev/null || { echo "tests/fuzz/run.sh: protoc not found (protobuf-compiler)" >&2; exit 1; }

build() {
  mkdir -p "$BUILD/gen" "$BUILD/obj"
  local proto="$ROOT/proto/foreshock/v1/ingest.proto"
  if [[ ! -f "$BUILD/gen/foreshock/v1/ingest.pb.cc" || "$proto" -nt "$BUILD/gen/foreshock/v1/ingest.pb.cc" ]]; then
    protoc -I"$ROOT/proto" --cpp_out="$BUILD/gen" "$proto"
  fi
  local flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
               -fno-omit-frame-pointer -I"$ROOT" -I"$BUILD/gen")
  local srcs deps
  if [[ "$TARGET" == store_recovery ]]; then
    srcs=("$HERE/store_recovery_fuzzer.cc" "$ROOT"/store/*.cc)
    deps=("$ROOT"/store/*.h)
  else
    srcs=("$HERE/request_fuzzer.cc" "$ROOT/wire/validation.cc"
          "$BUILD/gen/foreshock/v1/ingest.pb.cc")
    deps=("$ROOT/wire/validation.h" "$ROOT/detectors/sample.h")
  fi
  local newest=0 src
  for src in "${srcs[@]}" "${deps[@]}" "$0"; do
    [[ "$src" -nt "$BIN" ]] && newest=1
  done
  [[ -x "$BIN" && $newest == 0 ]] && return 0
  echo "building $BIN with $CXX" >&2
  # shellcheck disable=SC2046
  "$CXX" "${flags[@]}" "${srcs[@]}" -o "$BIN" $(pkg-config --libs protobuf absl_strings absl_status absl_statusor) -lpthread
}

mode="${1:-smoke}"
shift || true
build
case "$mode" in
  build) ;;
  smoke)
    runs="${1:-300000}"
    scratch="$(mktemp -d)"
    trap 'rm -rf "$scratch"' EXIT
    # New inputs go to a scratch directory; the committed corpus is only read.
    corpus=("$HERE/corpus")
    [[ "$TARGET" == store_recovery ]] && corpus=()
    "$BIN" -runs="$runs" -artifact_prefix="$BUILD/" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      "$scratch" "${corpus[@]}"
    ;;
  fuzz)
    mkdir -p "$BUILD/corpus"
    cd "$BUILD"
    "$BIN" -artifact_prefix="$BUILD/" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$@" \
      "$BUILD/corpus" "$HERE/corpus"
    ;;
  *) echo "usage: $0 build | smoke [RUNS] | fuzz [LIBFUZZER ARGS]" >&2; exit 2 ;;
esac
