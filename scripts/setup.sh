# Sourced by scripts/demo and scripts/test: installs the Debian packages that
# are missing (and only those), then configures and builds into ./build.
set -euo pipefail

FORESHOCK_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FORESHOCK_BUILD="${FORESHOCK_BUILD:-$FORESHOCK_ROOT/build}"
# Debian's interpreter: it is the one that sees python3-torch and python3-grpcio.
FORESHOCK_PYTHON=/usr/bin/python3

# Build toolchain, C++ libraries and the Python client's runtime.
FORESHOCK_PACKAGES=(
  cmake ninja-build ccache g++ pkg-config curl ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libeigen3-dev libabsl-dev libspdlog-dev libfmt-dev prometheus-cpp-dev libcivetweb-dev
  libyaml-cpp-dev nlohmann-json3-dev libcurl4-openssl-dev libssl-dev openssl
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-protobuf python3-numpy python3-torch libopenblas0-pthread
)

foreshock_install_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "==> installing Debian packages: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

foreshock_build() {
  echo "==> building into $FORESHOCK_BUILD"
  # The binaries run where they are built, so the detector math may use AVX2/FMA
  # (x86-64-v3) when this CPU has them. Not -march=native: on AVX-512 machines
  # GCC 12 miscompiled an initializer list in our tests at -O3.
  local march="${FORESHOCK_MARCH-}"
  if [ -z "${FORESHOCK_MARCH+set}" ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    march=x86-64-v3
  fi
  cmake -S "$FORESHOCK_ROOT" -B "$FORESHOCK_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFORESHOCK_MARCH="$march" >/dev/null
  cmake --build "$FORESHOCK_BUILD" -j "$(nproc)"
}

# Single-threaded BLAS inside each process: the machine has few cores and
# torch already uses them.
export OPENBLAS_NUM_THREADS=1
export PYTHONPATH="$FORESHOCK_ROOT/client/python:$FORESHOCK_ROOT${PYTHONPATH:+:$PYTHONPATH}"
