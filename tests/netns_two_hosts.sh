#!/usr/bin/env bash
# Two "hosts": ranks 0 and 1 of test_commux run in two network namespaces joined by a veth pair,
# with addresses that exist only inside those namespaces, over UCX_TLS=tcp (namespaces do not hide
# shared memory from UCX, so TCP is forced). Creates and removes the namespaces itself; exits 77
# (skipped) where namespaces are not permitted.
set -u
bin=${1:?usage: netns_two_hosts.sh TEST_COMMUX}
id=$$
nsa=cmx-a-$id nsb=cmx-b-$id
va=cmxa$id vb=cmxb$id
net=10.231.$((id % 250)).
ipa=${net}1 ipb=${net}2
port=$((20000 + id % 20000))

skip() { echo "SKIP: $*"; exit 77; }
cleanup() { ip netns del "$nsa" 2>/dev/null; ip netns del "$nsb" 2>/dev/null; }
trap cleanup EXIT

command -v ip >/dev/null || skip "iproute2 (ip) is not installed"
ip netns add "$nsa" 2>/dev/null || skip "cannot create network namespaces here (need root / CAP_SYS_ADMIN)"
ip netns add "$nsb" || skip "cannot create a second network namespace"
ip link add "$va" type veth peer name "$vb" || skip "cannot create a veth pair"
ip link set "$va" netns "$nsa" && ip link set "$vb" netns "$nsb" || exit 1
ip -n "$nsa" addr add "$ipa/24" dev "$va" && ip -n "$nsb" addr add "$ipb/24" dev "$vb" || exit 1
for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
ip -n "$nsa" link set "$va" up && ip -n "$nsb" link set "$vb" up || exit 1
if ip -o addr show | grep -q "$ipa/"; then echo "FAIL: $ipa is visible outside the namespace"; exit 1; fi

run_rank() {  # ns dev rank
  ip netns exec "$1" env UCX_TLS=tcp UCX_NET_DEVICES="$2" COMMUX_TEST_TIMEOUT_S=90 \
    timeout -s KILL 100 "$bin" "$3" 2 "$ipa" "$port"
}
run_rank "$nsa" "$va" 0 & p0=$!
run_rank "$nsb" "$vb" 1 & p1=$!
rc=0
wait $p0 || rc=1
wait $p1 || rc=1
tx=$(ip netns exec "$nsa" cat /sys/class/net/"$va"/statistics/tx_bytes)
rx=$(ip netns exec "$nsa" cat /sys/class/net/"$va"/statistics/rx_bytes)
echo "veth $va: tx $tx bytes, rx $rx bytes"
# check_all_pairs alone moves 1 MiB each way: the traffic must have crossed the veth.
if [ "$rc" = 0 ] && { [ "$tx" -lt 1000000 ] || [ "$rx" -lt 1000000 ]; }; then
  echo "FAIL: the ranks passed but their traffic did not cross the veth pair"; rc=1
fi
exit $rc
