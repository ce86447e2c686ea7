#!/usr/bin/env bash
# The Debian package, checked step by step; tests/deploy/CMakeLists.txt runs
# each step as one ctest test (the install/purge steps as a fixture, so the
# machine is left without the package even when a step in between fails).
#
#   deb.sh build    BUILD_DIR WORK_DIR   cpack -G DEB from BUILD_DIR into WORK_DIR
#   deb.sh info     WORK_DIR             dpkg-deb --info: name, version, depends, scripts, conffiles
#   deb.sh contents WORK_DIR             dpkg-deb --contents: binaries, unit, configuration
#   deb.sh install  WORK_DIR             dpkg -i (needs root); refuses if foreshock is already installed,
#                                        unless an earlier run of these tests left it (then purges it first)
#   deb.sh help                          the installed /usr/bin/foreshockd --help, foreshockctl --help
#   deb.sh run      WORK_DIR             the installed daemon starts with the installed configuration
#   deb.sh verify                        systemd-analyze verify (no warnings) and security of the installed unit
#   deb.sh purge    WORK_DIR             dpkg --purge, only if `install` (this or an earlier run) installed it
set -euo pipefail

step=$1
shift

fail() { echo "FAIL: $*" >&2; exit 1; }

# Says, across checkouts and reboots, that these tests installed the package.
machine_marker=/var/lib/foreshock-deb-test/installed-by-test

the_deb() {
  local debs=("$1"/foreshock_*_amd64.deb)
  [ -f "${debs[0]}" ] || fail "no foreshock_*_amd64.deb in $1 (did deploy_deb_build pass?)"
  [ ${#debs[@]} -eq 1 ] || fail "more than one .deb in $1: ${debs[*]}"
  echo "${debs[0]}"
}

case "$step" in
  build)
    build=$1 work=$2
    rm -rf "$work"
    mkdir -p "$work"
    cpack -G DEB --config "$build/CPackConfig.cmake" -B "$work"
    deb=$(the_deb "$work")
    version=$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$build/CPackConfig.cmake")
    [ "$(basename "$deb")" = "foreshock_${version}_amd64.deb" ] || fail "unexpected file name $deb"
    echo "built $deb"
    ;;
  info)
    deb=$(the_deb "$1")
    info=$(dpkg-deb --info "$deb")
    echo "$info"
    [ "$(dpkg-deb --field "$deb" Package)" = foreshock ] || fail "Package is not foreshock"
    [ "$(dpkg-deb --field "$deb" Architecture)" = amd64 ] || fail "Architecture is not amd64"
    depends=$(dpkg-deb --field "$deb" Depends)
    for lib in libc6 libstdc++6 libgrpc++ libprotobuf libcurl4 libyaml-cpp; do
      grep -q "$lib" <<<"$depends" || fail "Depends lacks $lib: $depends"
    done
    ctrl=$(mktemp -d)
    trap 'rm -rf "$ctrl"' EXIT
    dpkg-deb --control "$deb" "$ctrl"
    for script in postinst prerm postrm; do
      [ -x "$ctrl/$script" ] || fail "no executable $script"
      sh -n "$ctrl/$script" || fail "$script: syntax error"
    done
    diff <(sort "$ctrl/conffiles") <(printf '%s\n' /etc/foreshock/foreshock.yaml /etc/foreshock/foreshockd.env) \
      || fail "conffiles differ"
    ;;
  contents)
    deb=$(the_deb "$1")
    contents=$(dpkg-deb --contents "$deb")
    echo "$contents"
    for want in \
        '-rwxr-xr-x root/root .* ./usr/bin/foreshockd$' \
        '-rwxr-xr-x root/root .* ./usr/bin/foreshockctl$' \
        '-rw-r--r-- root/root .* ./lib/systemd/system/foreshockd.service$' \
        '-rw-r--r-- root/root .* ./etc/foreshock/foreshock.yaml$' \
        '-rw-r--r-- root/root .* ./etc/foreshock/foreshockd.env$'; do
      grep -qE -- "$want" <<<"$contents" || fail "no entry matching: $want"
    done
    # Nothing else: no headers, static libraries or test binaries.
    files=$(grep -vc '^d' <<<"$contents")
    [ "$files" -eq 5 ] || fail "expected 5 files, found $files"
    ;;
  install)
    work=$1
    deb=$(the_deb "$work")
    [ "$(id -u)" -eq 0 ] || fail "dpkg -i needs root"
    if dpkg-query -W -f='${Status}' foreshock 2>/dev/null | grep -q 'ok installed\|config-files'; then
      if [ -f "$machine_marker" ]; then
        # An earlier run of these tests (another checkout, or one stopped
        # before its purge step) installed it: ours to remove.
        echo "foreshock was left installed by an earlier run of these tests ($(cat "$machine_marker")); purging it"
        dpkg --purge foreshock
        rm -f "$machine_marker"
      else
        fail "a foreshock package is already on this machine; not touching it (dpkg --purge foreshock first)"
      fi
    fi
    # Marked before dpkg runs, here and machine-wide, so that a run stopped
    # anywhere after this point leaves its package recognisable as its own.
    mkdir -p "$(dirname "$machine_marker")"
    echo "$deb" >"$machine_marker"
    touch "$work/installed-by-test"
    dpkg -i "$deb"
    dpkg-query -W -f='${Status}\n' foreshock | grep -q 'install ok installed' || fail "not installed"
    ;;
  help)
    out=$(/usr/bin/foreshockd --help 2>&1) || true   # absl's --help exits with 1
    grep -q 'Usage: foreshockd' <<<"$out" || fail "foreshockd --help: $out"
    grep -q -- '--data_dir' <<<"$out" || fail "foreshockd --help lists no --data_dir"
    /usr/bin/foreshockctl --help | grep -q 'Usage: foreshockctl' || fail "foreshockctl --help"
    ;;
  run)
    # The unit's command line (the installed configuration and env file) with a
    # temporary data directory and free ports; the daemon must come up, serve
    # /-/healthy and stop cleanly on SIGTERM.
    work=$1
    # shellcheck disable=SC1091
    . /etc/foreshock/foreshockd.env
    [ -n "${FORESHOCKD_ARGS:-}" ] || fail "/etc/foreshock/foreshockd.env sets no FORESHOCKD_ARGS"
    data=$(mktemp -d)
    log="$work/run.log"
    # FORESHOCKD_ARGS first, so the free ports below override its listen addresses.
    # shellcheck disable=SC2086
    /usr/bin/foreshockd $FORESHOCKD_ARGS --config /etc/foreshock/foreshock.yaml --data_dir="$data" \
      --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 >"$log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null || true; rm -rf "$data"' EXIT
    port=""
    for _ in $(seq 100); do
      port=$(sed -n 's/.*metrics, API and UI on .* (port \([0-9]*\)).*/\1/p' "$log" | head -1)
      [ -n "$port" ] && break
      kill -0 "$pid" 2>/dev/null || { cat "$log"; fail "foreshockd exited at start"; }
      sleep 0.1
    done
    [ -n "$port" ] || { cat "$log"; fail "foreshockd did not start in 10 s"; }
    curl -fsS "http://127.0.0.1:$port/-/healthy" | grep -q ok || fail "/-/healthy"
    kill -TERM "$pid"
    rc=0
    wait "$pid" || rc=$?
    [ "$rc" -eq 0 ] || { cat "$log"; fail "foreshockd exited with $rc on SIGTERM"; }
    cat "$log"
    ;;
  verify)
    # verify exits 0 on unknown keys and bad values (it only warns): any output fails.
    out=$(systemd-analyze verify /lib/systemd/system/foreshockd.service 2>&1) \
      || fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify warns: $out"
    # The hardening, as systemd scores it (0 best, 10 worst; 1.3 when written).
    systemd-analyze security --offline=yes --threshold=20 /lib/systemd/system/foreshockd.service \
      || fail "systemd-analyze security: exposure above 2.0"
    # verify does not judge the values; check the ones the package promises.
    unit=/lib/systemd/system/foreshockd.service
    for want in 'DynamicUser=yes' 'StateDirectory=foreshock' 'Restart=on-failure' \
        'NoNewPrivileges=yes' 'ProtectSystem=strict' 'ProtectHome=yes' 'PrivateTmp=yes' \
        'EnvironmentFile=-/etc/foreshock/foreshockd.env' 'MemoryMax=' 'LimitNOFILE=' \
        'ExecStart=/usr/bin/foreshockd --config /etc/foreshock/foreshock.yaml --data_dir=/var/lib/foreshock $FORESHOCKD_ARGS'; do
      grep -qxF -- "$want" "$unit" || grep -q "^$want" "$unit" || fail "$unit lacks $want"
    done
    ;;
  purge)
    work=$1
    if [ -f "$work/installed-by-test" ] || [ -f "$machine_marker" ]; then
      rm -f "$work/installed-by-test" "$machine_marker"
      dpkg --purge foreshock
      ! dpkg-query -W -f='${Status}' foreshock 2>/dev/null | grep -q 'installed' || fail "still installed"
      for path in /usr/bin/foreshockd /usr/bin/foreshockctl /lib/systemd/system/foreshockd.service /etc/foreshock; do
        [ ! -e "$path" ] || fail "$path left after purge"
      done
    else
      echo "the install step did not install foreshock; nothing to purge"
    fi
    ;;
  *)
    fail "unknown step $step"
    ;;
esac
