#!/usr/bin/env bash
# Hosts on one machine: N Linux network namespaces ("hosts") joined by veth pairs through a bridge,
# so that MPI ranks launched in them talk over TCP only (no shared memory), optionally rate-limited.
#
#   tests/netns/netns.sh check                      # exit 0 if it can run here, else 77 and the reason
#   tests/netns/netns.sh [options] -- COMMAND...    # make the hosts, run COMMAND, tear them down
#
# Options:
#   -n N            hosts (2..8, default 4): namespaces <prefix>h0 .. h<N-1>, addresses 10.213.0.1 .. N/24
#   --rate R        egress rate of every host's NIC and of every bridge port (tc tbf), e.g. 1gbit, 500mbit:
#                   a full-duplex link of rate R per host (the switch itself is not limited)
#   --delay D       one-way delay per NIC (tc netem, e.g. 50us); refused with a reason if the kernel has no netem
#   --mpi KIND      mpich (default: the MPICH of $MPIEXEC or next to python) or openmpi (/usr/bin/mpirun.openmpi)
#   --timeout S     wall-clock bound of COMMAND in seconds (default 600); the hosts are removed in any case
#   --stats FILE    write the bytes each host's NIC sent/received during COMMAND (JSON) to FILE
#
# COMMAND runs in the root namespace with these variables set:
#   NETNS_MPIEXEC   an mpiexec that places rank r on host r mod N (one rank per host for P <= N) and
#                   runs it inside that host's namespace: "$NETNS_MPIEXEC -n 4 python -m pytest ..."
#   NETNS_HOSTS     the hosts' addresses (comma list);  NETNS_PREFIX  the namespaces' name prefix
#   NETNS_NS        the namespaces (space-separated);   NETNS_MPI     mpich | openmpi
# MPICH runs ch4:ofi with libfabric's tcp provider on eth0 and MPIR_CVAR_NOLOCAL=1 (no shared memory
# even between ranks of one host); Open MPI runs btl tcp,self and its out-of-band channel on the
# test subnet. Hydra / orted reach the other hosts through a launcher that is `ip netns exec`.
#
# Names are unique per run (prefix hz<pid>-), the subnet exists only inside the namespaces (nothing
# is added to the root namespace), and a trap removes every namespace (and with it the veths and the
# bridge) on exit, error or signal. Needs root, iproute2 (ip, tc for --rate/--delay).
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SUBNET=10.213.0
N=4 RATE="" DELAY="" MPIKIND=mpich TIMEOUT=600 STATS=""

skip() { echo "netns: cannot run here: $*" >&2; exit 77; }

can_run() {
  [ "$(id -u)" = 0 ] || skip "not root (network namespaces need CAP_NET_ADMIN)"
  command -v ip >/dev/null 2>&1 || skip "no 'ip' (iproute2) on PATH"
  local probe="hzprobe$$"
  ip netns add "$probe" 2>/dev/null || skip "'ip netns add' failed (no network namespace support or no permission)"
  local ok=1
  ip link add eth0 netns "$probe" type veth peer name eth1 netns "$probe" 2>/dev/null || ok=0
  ip netns del "$probe" 2>/dev/null
  [ "$ok" = 1 ] || skip "cannot create veth pairs"
  if [ -n "$RATE" ] || [ -n "$DELAY" ]; then command -v tc >/dev/null 2>&1 || skip "no 'tc' for --rate/--delay"; fi
}

if [ "${1:-}" = check ]; then can_run; echo "netns: ok (root, ip, namespaces, veth)"; exit 0; fi

while [ $# -gt 0 ]; do
  case "$1" in
    -n) N=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --mpi) MPIKIND=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --stats) STATS=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "netns: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "netns: no COMMAND given (netns.sh [options] -- COMMAND...)" >&2; exit 2; }
case "$N" in [2-8]) ;; *) echo "netns: -n must be 2..8, got $N" >&2; exit 2 ;; esac
case "$MPIKIND" in mpich|openmpi) ;; *) echo "netns: --mpi must be mpich or openmpi" >&2; exit 2 ;; esac
can_run

PY=${PYTHON:-$(command -v python3)}
if [ "$MPIKIND" = mpich ]; then
  MPIEXEC_BIN=${MPIEXEC:-$(dirname "$PY")/mpiexec}
  [ -x "$MPIEXEC_BIN" ] || skip "no MPICH mpiexec at $MPIEXEC_BIN (set MPIEXEC)"
  "$MPIEXEC_BIN" -info 2>/dev/null | grep -q HYDRA || skip "$MPIEXEC_BIN is not MPICH's hydra"
else
  MPIEXEC_BIN=${MPIEXEC_OPENMPI:-/usr/bin/mpirun.openmpi}
  [ -x "$MPIEXEC_BIN" ] || skip "no Open MPI mpirun at $MPIEXEC_BIN (set MPIEXEC_OPENMPI)"
fi

PFX="hz$$-"
WORK=$(mktemp -d "/tmp/${PFX}XXXX")
NSS=()
for i in $(seq 0 $((N - 1))); do NSS+=("${PFX}h$i"); done
SW="${PFX}sw"

cleanup() {
  local ns
  for ns in "${NSS[@]}" "$SW"; do
    if ip netns list 2>/dev/null | grep -q "^$ns\b"; then
      # end what still runs in our namespaces (only processes this script started live there)
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null; done
    fi
  done
  sleep 0.2
  for ns in "${NSS[@]}" "$SW"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

die() { echo "netns: $*" >&2; exit 1; }

tbf() {  # tbf on device $2 in namespace $1 at $RATE (burst: 1 ms of traffic, at least 64 KiB)
  local bps burst
  bps=$(python3 - "$RATE" <<'EOF'
import re, sys
m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)?", sys.argv[1].lower())
if not m:
    sys.exit(1)
v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
print(int(v / 8 if (m.group(3) or "bit") == "bit" else v))
EOF
  ) || die "--rate $RATE: expected e.g. 1gbit, 500mbit"
  burst=$(( bps / 1000 > 65536 ? bps / 1000 : 65536 ))
  tc -n "$1" qdisc replace dev "$2" root tbf rate "$RATE" burst "$burst" latency 100ms \
    || die "tc tbf on $1/$2 failed"
}

ip netns add "$SW" || die "ip netns add $SW failed"
ip -n "$SW" link add br0 type bridge || die "no bridge support"
ip -n "$SW" link set br0 up
HOSTS=()
for i in $(seq 0 $((N - 1))); do
  ns=${NSS[$i]} addr="$SUBNET.$((i + 1))"
  ip netns add "$ns" || die "ip netns add $ns failed"
  ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$SW" || die "veth for $ns failed"
  ip -n "$SW" link set "p$i" master br0 up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 mtu 1500 up
  if [ -n "$DELAY" ]; then
    tc -n "$ns" qdisc replace dev eth0 root netem delay "$DELAY" ${RATE:+rate "$RATE"} 2>/dev/null \
      || skip "tc netem is not available in this kernel (--delay $DELAY); --rate alone uses tbf"
    [ -n "$RATE" ] && tbf "$SW" "p$i"
  elif [ -n "$RATE" ]; then
    tbf "$ns" eth0
    tbf "$SW" "p$i"
  fi
  HOSTS+=("$addr")
done
# wait until every host reaches host 0 (the bridge learns addresses; ARP)
for i in $(seq 1 $((N - 1))); do
  ok=0
  for _ in $(seq 1 50); do
    if ip netns exec "${NSS[$i]}" "$PY" -c "
import socket, sys
s = socket.socket(); s.settimeout(0.2)
try:
    s.connect(('$SUBNET.1', 9)); sys.exit(0)
except ConnectionRefusedError:
    sys.exit(0)
except OSError:
    sys.exit(1)" 2>/dev/null; then ok=1; break; fi
    sleep 0.1
  done
  [ "$ok" = 1 ] || die "host ${NSS[$i]} cannot reach $SUBNET.1"
done

# launcher: "nsexec [options] HOST COMMAND..." -> run COMMAND in HOST's namespace (what ssh would do)
{
  echo '#!/bin/sh'
  echo 'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done'
  echo 'host=$1; shift'
  echo 'case "$host" in'
  for i in $(seq 0 $((N - 1))); do echo "  ${HOSTS[$i]}|h$i) ns=${NSS[$i]} ;;"; done
  echo '  *) echo "nsexec: unknown host $host" >&2; exit 1 ;;'
  echo 'esac'
  echo 'exec ip netns exec "$ns" sh -c "$*"'
} > "$WORK/nsexec"
chmod +x "$WORK/nsexec"

HOSTLIST=$(IFS=,; echo "${HOSTS[*]}")
if [ "$MPIKIND" = mpich ]; then
  for h in "${HOSTS[@]}"; do echo "$h:1"; done > "$WORK/hosts"
  cat > "$WORK/mpiexec" <<EOF
#!/bin/sh
# MPICH hydra across the namespace hosts: ch4:ofi over libfabric's tcp provider, no shared memory
exec ip netns exec ${NSS[0]} env -u HYDRA_LAUNCHER -u HYDRA_HOST_FILE \\
  MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0 MPIR_CVAR_NOLOCAL=1 \\
  MPIR_CVAR_CH4_OFI_ENABLE_SHARED_CONTEXTS=0 \\
  "$MPIEXEC_BIN" -f "$WORK/hosts" -launcher ssh -launcher-exec "$WORK/nsexec" -iface eth0 "\$@"
EOF
else
  # Open MPI: a host list with one slot per host, rsh agent = nsexec, TCP only on the test subnet
  cat > "$WORK/mpiexec" <<EOF
#!/bin/sh
exec ip netns exec ${NSS[0]} env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
  OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=$SUBNET.0/24 OMPI_MCA_oob_tcp_if_include=$SUBNET.0/24 \\
  OMPI_MCA_plm_rsh_agent="$WORK/nsexec" OMPI_MCA_pml=ob1 OMPI_MCA_rmaps_base_oversubscribe=1 \\
  "$MPIEXEC_BIN" --host "$(for h in "${HOSTS[@]}"; do printf '%s:8,' "$h"; done | sed 's/,$//')" \\
  --map-by node -x PATH -x PYTHONPATH -x MPI4PY_LIBMPI "\$@"
EOF
fi
chmod +x "$WORK/mpiexec"

counters() {  # "tx rx" bytes of every host's eth0
  for ns in "${NSS[@]}"; do
    echo "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)" \
         "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)"
  done
}
before=$(counters)
echo "netns: $N hosts ${HOSTS[*]} (namespaces ${NSS[*]}; bridge in $SW), mpi $MPIKIND" \
     "${RATE:+rate $RATE per NIC }${DELAY:+delay $DELAY }timeout ${TIMEOUT}s" >&2
export NETNS_MPIEXEC="$WORK/mpiexec" NETNS_HOSTS="$HOSTLIST" NETNS_PREFIX="$PFX" NETNS_NS="${NSS[*]}" \
       NETNS_MPI="$MPIKIND" NETNS_RATE="$RATE" NETNS_DELAY="$DELAY"
timeout --kill-after=10 "$TIMEOUT" "$@"
rc=$?
[ "$rc" = 124 ] && echo "netns: COMMAND exceeded --timeout ${TIMEOUT}s" >&2
after=$(counters)
report=$(paste <(echo "$before") <(echo "$after") | awk -v hosts="${HOSTS[*]}" '
  BEGIN { split(hosts, H, " "); printf "{\"hosts\": [" }
  { printf "%s{\"host\": \"%s\", \"tx_bytes\": %d, \"rx_bytes\": %d}", (NR > 1 ? ", " : ""), H[NR], $3 - $1, $4 - $2 }
  END { printf "]}\n" }')
echo "netns: bytes through the hosts' NICs: $report" >&2
[ -n "$STATS" ] && echo "$report" > "$STATS"
exit "$rc"
