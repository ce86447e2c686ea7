"""Sharding runs across several foreshockd daemons.

Every rank of a run must reach the same daemon: its detectors pair
consecutive samples of a run and its alert engine judges the run's whole
history. The client therefore picks the daemon from the run id alone, by
rendezvous (highest-random-weight) hashing over the daemon list:

    score(endpoint) = first 8 bytes of blake2b(endpoint + "\\0" + run_id)
    daemon(run)     = the endpoint with the highest score

Every process that is given the same endpoint set computes the same daemon
for a run, whatever the order of the list and without talking to anyone.
Adding an endpoint moves only the runs that now score highest on it (about
1/N of them); removing one moves only the runs it held.

The endpoint specification, as Monitor(endpoint=...) takes it:

- "host:port": one daemon, as before. If the name resolves to several
  addresses of one family (e.g. a Kubernetes headless Service's A records),
  runs are sharded over those addresses; if it resolves to one address, or
  not at all, the name is used as given (gRPC resolves it).
- "a:1,b:2,c:3" or a list ["a:1", "b:2", "c:3"]: shard over these.
- "dns:///name:port" (gRPC's target syntax; "dns:name:port" too): shard over
  every address the name resolves to now. An unresolvable name is an error.

Resolution happens once, when the Monitor is created: a run keeps its daemon
for the life of the process (moving mid-run would split its series between
two daemons). Restarted ranks resolve again, so keep the daemon set stable
while a run is live (a StatefulSet with publishNotReadyAddresses, or an
explicit list of stable names; see docs/OPERATIONS.md).

    python3 -m foreshock.sharding RUN_ID SPEC   # prints the daemon of RUN_ID
"""
import hashlib
import ipaddress
import socket

__all__ = ["parse", "resolve", "pick", "endpoint_for"]


def parse(spec):
    """Splits an endpoint specification (a string or a list of strings) into its
    entries, stripped, order and duplicates kept out. Raises ValueError when empty."""
    if isinstance(spec, (list, tuple)):
        parts = [str(p) for p in spec]
    else:
        parts = str(spec).split(",")
    entries = []
    for part in parts:
        part = part.strip()
        if part and part not in entries:
            entries.append(part)
    if not entries:
        raise ValueError(f"no foreshockd endpoint in {spec!r}")
    return entries


def _split_host_port(entry):
    """'host:port' or '[v6]:port' -> (host, port)."""
    if entry.startswith("["):
        host, sep, port = entry[1:].partition("]:")
    else:
        host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"foreshockd endpoint {entry!r} is not host:port")
    return host, int(port)


def _format(address, port):
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _lookup(host, port):
    """The addresses of host, IPv4 when it has any, else IPv6; sorted, deduplicated.
    (A name such as 'localhost' that has both 127.0.0.1 and ::1 is one machine, not two
    daemons.)"""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({info[4][0] for info in infos if info[0] == socket.AF_INET},
                key=ipaddress.ip_address)
    v6 = sorted({info[4][0].split("%")[0] for info in infos if info[0] == socket.AF_INET6},
                key=ipaddress.ip_address)
    return [_format(a, port) for a in (v4 or v6)]


def _is_literal(host):
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def resolve(spec):
    """The daemons to shard over, as a sorted list of 'host:port' strings (see the
    module docstring for the forms of spec)."""
    entries = parse(spec)
    if len(entries) > 1:
        for entry in entries:
            if entry.startswith("dns:"):
                raise ValueError(f"{entry!r}: a dns: target cannot be part of a list")
            _split_host_port(entry)
        return sorted(entries)
    (entry,) = entries
    if entry.startswith("dns:"):
        name = entry[len("dns:"):]
        if name.startswith("//"):
            authority, _, name = name[2:].partition("/")
            if authority:
                raise ValueError(f"{entry!r}: a DNS server in the target is not supported; "
                                 "use dns:///name:port (the system resolver)")
        host, port = _split_host_port(name)
        try:
            addresses = _lookup(host, port)
        except socket.gaierror as error:
            raise ValueError(f"cannot resolve foreshockd endpoint {entry!r}: {error}") from None
        if not addresses:
            raise ValueError(f"foreshockd endpoint {entry!r} resolves to no address")
        return addresses
    host, port = _split_host_port(entry)
    if _is_literal(host):
        return [entry]
    try:
        addresses = _lookup(host, port)
    except (socket.gaierror, UnicodeError):
        return [entry]  # not resolvable now: gRPC will keep trying the name
    return addresses if len(addresses) > 1 else [entry]


def _score(endpoint, run_id):
    digest = hashlib.blake2b(f"{endpoint}\0{run_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick(run_id, endpoints):
    """The endpoint of `endpoints` (already resolved) that serves run_id."""
    endpoints = parse(endpoints)
    if len(endpoints) == 1:
        return endpoints[0]
    # Ties (a 64-bit collision) go to the smaller endpoint, so the choice never
    # depends on the list's order.
    return max(sorted(endpoints), key=lambda e: _score(e, run_id))


def endpoint_for(run_id, spec):
    """resolve(spec), then pick(run_id, ...): the daemon a Monitor for run_id uses."""
    return pick(run_id, resolve(spec))


def _main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(
        prog="python3 -m foreshock.sharding",
        description="Print the foreshockd endpoint that serves a run.")
    parser.add_argument("run_id")
    parser.add_argument("spec", help='"host:port", "a:1,b:2,...", or "dns:///name:port"')
    parser.add_argument("--all", action="store_true", help="also list the resolved daemons")
    args = parser.parse_args(argv)
    endpoints = resolve(args.spec)
    if args.all:
        for endpoint in endpoints:
            print(("* " if endpoint == pick(args.run_id, endpoints) else "  ") + endpoint)
    else:
        print(pick(args.run_id, endpoints))


if __name__ == "__main__":
    _main()
