#!/usr/bin/env bash
# Where a greendot server's memory goes per session, by owner, from a
# heaptrack profile taken while it held SESSIONS sessions (see
# docs/benchmarks.md, "End-to-end QUIC load"). Needs heaptrack (Debian's
# package). Counts each allocation site's share of the peak heap.
#
#   bench/heap-owners.sh heaptrack.greendot.1234.zst 2000
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 HEAPTRACK_FILE SESSIONS" >&2
    exit 2
fi
file=$1
sessions=$2
stacks=$(mktemp)
trap 'rm -f "$stacks"' EXIT
heaptrack_print -f "$file" --flamegraph-cost-type peak -F "$stacks" >/dev/null
# One folded stack per line, its bytes last. The first rule that matches a
# stack names its owner; symbols may be mangled, so match on crate names.
awk -v n="$sessions" '
{
    bytes = $NF
    owner = "other (runtime, sockets, shared buffers)"
    if ($0 ~ /rustls/) owner = "rustls"
    else if ($0 ~ /quinn_proto/) owner = "quinn-proto, allocations"
    else if ($0 ~ /on_datagram/) owner = "quinn-proto Connection and server fields (one boxed slot)"
    else if ($0 ~ /greendot_core/) owner = "greendot core"
    else if ($0 ~ /greendot/) owner = "greendot server"
    sum[owner] += bytes
    total += bytes
}
END {
    printf "| owner | KiB per session |\n|---|---:|\n"
    for (o in sum) printf "| %s | %.1f |\n", o, sum[o] / n / 1024 | "sort -t\"|\" -k3 -rn"
    close("sort -t\"|\" -k3 -rn")
    printf "| all | %.1f |\n", total / n / 1024
}' "$stacks"
