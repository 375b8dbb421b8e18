# Shared by the process tests (sourced): several "hosts" on this machine.
#
# A host is a network namespace with one interface, eth0, on a Linux bridge
# of the test's own (10.77.0.<i+1>/24 for host i, beside loopback; no
# route out), a hostname of its own (UTS namespace) and a /dev/shm of its
# own (a private tmpfs in a mount namespace of its own). So zeroshardd,
# gpt_train and UCX on two hosts see two machines: they reach each other
# only over the bridge, and find neither each other's shared memory nor the
# same hostname. They still share the filesystem (but /dev/shm), the PID
# namespace and the users: a transport that reaches another process by pid
# (UCX's cma) is not fenced off by these namespaces. Every bridge is a
# separate network, so concurrent tests may all use 10.77.0.0/24; this
# namespace gets no address on it.
#
# Each host's namespaces are held by a process of its own (a `sleep`
# started where the tmpfs was mounted and the hostname set), which
# zs_on_host enters, so every process started on a host shares that host's
# /dev/shm. Whatever runs on a host, in the foreground or the background, is
# found at teardown by its network namespace (`ip netns pids`) and killed.
#
# Usage:
#   source hosts.sh
#   trap zs_hosts_teardown EXIT      (or call it from the caller's EXIT trap)
#   zs_hosts_check || { echo "SKIPPED: $ZS_HOSTS_ERROR"; exit 0; }
#   zs_hosts_setup 2 || fail "$ZS_HOSTS_ERROR"
#   zs_on_host 0 CMD...              (${ZS_HOST_ADDRS[0]} is host 0's address)
#   read -r rx tx < <(zs_host_link_bytes 1)
#
# Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), ip, unshare and nsenter.

# This run's names: interfaces ${ZS_HOSTS_TAG}v<i> (bridge side of host i's
# veth pair) and ${ZS_HOSTS_TAG}br, namespaces ${ZS_HOSTS_TAG}-h<i>; at most
# 15 characters for an interface name.
ZS_HOSTS_TAG="zh$$"
ZS_HOSTS_SUBNET="10.77.0"
ZS_HOST_ADDRS=()      # host i's address on the bridge
ZS_HOST_NAMES=()      # host i's hostname: h<i>
ZS_HOST_HOLDERS=()    # pid of the process holding host i's namespaces
ZS_HOSTS_ERROR=""     # why the last zs_hosts_check or zs_hosts_setup failed
_ZS_HOSTS_NETNS=()    # namespaces made, for teardown
_ZS_HOSTS_LINKS=()    # interfaces made here, for teardown

# _zs_hosts_err MESSAGE COMMAND...: runs COMMAND; on failure sets
# ZS_HOSTS_ERROR to "MESSAGE: <its stderr>" and returns 1.
_zs_hosts_err() {
  local what="$1" out
  shift
  if ! out="$("$@" 2>&1)"; then
    ZS_HOSTS_ERROR="$what: ${out:-exit status $?}"
    return 1
  fi
}

# A host's setup, run by `sh -c` in its new namespaces with the hostname as
# $1: a private tmpfs on /dev/shm and the hostname, then "ready".
_ZS_HOST_SETUP_SCRIPT='
mount -t tmpfs -o size=512m,mode=1777 "zs-shm-$1" /dev/shm || exit 125
hostname "$1" || exit 125
echo ready'

# zs_hosts_check: 0 if hosts can be made here (a bridge, a network
# namespace, and unshare --uts --mount with a tmpfs on /dev/shm in it);
# else 1 with the reason in ZS_HOSTS_ERROR. Leaves nothing behind.
zs_hosts_check() {
  local probe="${ZS_HOSTS_TAG}-probe" rc=0 cmd out
  for cmd in ip unshare nsenter mount; do
    if ! command -v "$cmd" >/dev/null; then
      ZS_HOSTS_ERROR="no $cmd command"
      return 1
    fi
  done
  _zs_hosts_err "ip netns add refused" ip netns add "$probe" || return 1
  _zs_hosts_err "ip link add type bridge refused" ip link add "${ZS_HOSTS_TAG}pb" type bridge ||
    rc=1
  ip link del "${ZS_HOSTS_TAG}pb" 2>/dev/null
  if ((rc == 0)); then
    out="$(timeout 10 ip netns exec "$probe" unshare --uts --mount \
      sh -c "$_ZS_HOST_SETUP_SCRIPT" sh probe </dev/null 2>&1)"
    if [[ "$out" != ready ]]; then
      ZS_HOSTS_ERROR="unshare --uts --mount with a tmpfs on /dev/shm refused: $out"
      rc=1
    fi
  fi
  ip netns del "$probe" 2>/dev/null
  return $rc
}

# _zs_hosts_kill_netns NS: SIGKILLs every process in network namespace NS
# and waits (at most 10 s) until none is left.
_zs_hosts_kill_netns() {
  local ns="$1" pids deadline=$((SECONDS + 10))
  while pids="$(ip netns pids "$ns" 2>/dev/null)" && [[ -n "$pids" ]]; do
    # shellcheck disable=SC2086  # one pid per word
    kill -9 $pids 2>/dev/null
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
  return 0
}

# zs_hosts_setup N: hosts 0..N-1 on a new bridge. On failure sets
# ZS_HOSTS_ERROR and returns 1 (zs_hosts_teardown removes what was made).
zs_hosts_setup() {
  local n="$1" i ns veth br="${ZS_HOSTS_TAG}br"
  _zs_hosts_err "could not create bridge $br" ip link add "$br" type bridge || return 1
  _ZS_HOSTS_LINKS+=("$br")
  _zs_hosts_err "could not bring up $br" ip link set "$br" up || return 1
  for ((i = 0; i < n; i++)); do
    ns="${ZS_HOSTS_TAG}-h$i"
    veth="${ZS_HOSTS_TAG}v$i"
    _zs_hosts_err "could not create namespace $ns" ip netns add "$ns" || return 1
    _ZS_HOSTS_NETNS+=("$ns")
    _zs_hosts_err "could not create veth $veth" \
      ip link add "$veth" type veth peer name "${ZS_HOSTS_TAG}p$i" || return 1
    _ZS_HOSTS_LINKS+=("$veth")
    _zs_hosts_err "could not attach $veth" ip link set "$veth" master "$br" || return 1
    _zs_hosts_err "could not bring up $veth" ip link set "$veth" up || return 1
    _zs_hosts_err "could not move the veth into $ns" \
      ip link set "${ZS_HOSTS_TAG}p$i" netns "$ns" || return 1
    _zs_hosts_err "could not rename the veth in $ns" \
      ip -n "$ns" link set "${ZS_HOSTS_TAG}p$i" name eth0 || return 1
    _zs_hosts_err "could not address eth0 in $ns" \
      ip -n "$ns" addr add "$ZS_HOSTS_SUBNET.$((i + 1))/24" dev eth0 || return 1
    _zs_hosts_err "could not bring up eth0 in $ns" ip -n "$ns" link set eth0 up || return 1
    _zs_hosts_err "could not bring up lo in $ns" ip -n "$ns" link set lo up || return 1
    ZS_HOST_ADDRS[$i]="$ZS_HOSTS_SUBNET.$((i + 1))"
    ZS_HOST_NAMES[$i]="h$i"
    _zs_host_start_holder "$i" || return 1
  done
  _zs_hosts_wait_links "$n"
}

# _zs_host_start_holder I: the process holding host I's UTS and mount
# namespaces; sets ZS_HOST_HOLDERS[I] once it is ready (at most 10 s).
_zs_host_start_holder() {
  local i="$1" fifo
  fifo="$(mktemp -u "${TMPDIR:-/tmp}/zs_host_holder.XXXXXX")"
  mkfifo "$fifo" || { ZS_HOSTS_ERROR="mkfifo $fifo failed"; return 1; }
  # ip netns exec, unshare and sh each exec the next: $! is the holder.
  ip netns exec "${ZS_HOSTS_TAG}-h$i" unshare --uts --mount \
    sh -c "$_ZS_HOST_SETUP_SCRIPT"' && exec sleep infinity' sh "${ZS_HOST_NAMES[$i]}" \
    </dev/null >"$fifo" 2>&1 &
  ZS_HOST_HOLDERS[$i]=$!
  # Not a job of this shell: no "Killed" line for it at teardown.
  disown "$!"
  local line=""
  read -r -t 10 line <"$fifo"
  rm -f "$fifo"
  if [[ "$line" != ready ]]; then
    ZS_HOSTS_ERROR="host $i's namespaces did not come up: ${line:-no answer in 10 s}"
    return 1
  fi
}

# _zs_hosts_wait_links N: waits (at most 10 s) until each host's eth0 can
# send (the bridge port leaves its listening state).
_zs_hosts_wait_links() {
  local n="$1" i deadline=$((SECONDS + 10)) state
  for ((i = 0; i < n; i++)); do
    while :; do
      state="$(cat "/sys/class/net/${ZS_HOSTS_TAG}v$i/brport/state" 2>/dev/null)"
      [[ "$state" == 3 || -z "$state" ]] && break  # 3: forwarding
      if ((SECONDS >= deadline)); then
        ZS_HOSTS_ERROR="bridge port of host $i not forwarding after 10 s (state $state)"
        return 1
      fi
      sleep 0.05
    done
  done
}

# zs_on_host I CMD...: runs CMD on host I (its network, UTS and mount
# namespaces: its address, hostname and /dev/shm), in the current
# directory, with this shell's environment. Its exit status is CMD's.
# Run it in the background with & as any command; teardown kills what is
# left (zs_host_kill does it for one host).
zs_on_host() {
  local i="$1"
  shift
  nsenter --target "${ZS_HOST_HOLDERS[$i]}" --net --uts --mount --wd="$PWD" -- "$@"
}

# zs_host_pids I: the processes running on host I, one per line (the
# namespaces' holder among them).
zs_host_pids() { ip netns pids "${ZS_HOSTS_TAG}-h$1" 2>/dev/null; }

# zs_host_kill I: SIGKILLs every process on host I but its holder, and waits
# (at most 10 s) until they are gone. 1 if some are left.
zs_host_kill() {
  local i="$1" pids pid deadline=$((SECONDS + 10))
  while :; do
    pids=()
    while read -r pid; do
      [[ -n "$pid" && "$pid" != "${ZS_HOST_HOLDERS[$i]}" ]] && pids+=("$pid")
    done < <(zs_host_pids "$i")
    ((${#pids[@]} == 0)) && return 0
    kill -9 "${pids[@]}" 2>/dev/null
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
}

# zs_host_link_bytes I: "RX TX" of host I's link, as host I sees it (bytes
# it received, bytes it sent), from the bridge side of its veth pair, where
# the counts are the other way round. Every frame that left or reached the
# host over the bridge counts, headers included; loopback traffic does not.
zs_host_link_bytes() {
  local stats="/sys/class/net/${ZS_HOSTS_TAG}v$1/statistics"
  echo "$(<"$stats/tx_bytes") $(<"$stats/rx_bytes")"
}

# zs_hosts_teardown: kills every process on every host, removes the
# namespaces, the veth pairs and the bridge. Safe to call more than once,
# and after a partial zs_hosts_setup.
zs_hosts_teardown() {
  local ns link
  for ns in "${_ZS_HOSTS_NETNS[@]}"; do _zs_hosts_kill_netns "$ns"; done
  # Deleting the bridge side of a veth pair deletes both ends at once (a
  # namespace's own interfaces go away only later, asynchronously).
  for link in "${_ZS_HOSTS_LINKS[@]}"; do ip link del "$link" 2>/dev/null; done
  for ns in "${_ZS_HOSTS_NETNS[@]}"; do ip netns del "$ns" 2>/dev/null; done
  _ZS_HOSTS_NETNS=()
  _ZS_HOSTS_LINKS=()
  ZS_HOST_HOLDERS=()
}

# zs_hosts_resolve_names: every host resolves each host's name (h<i>) to its
# address on the bridge, as a cluster's DNS would: a hosts file naming
# localhost and the hosts, bind-mounted over /etc/hosts in each host's mount
# namespace (this namespace's /etc/hosts is untouched). Call after
# zs_hosts_setup. On failure sets ZS_HOSTS_ERROR and returns 1.
zs_hosts_resolve_names() {
  local file i rc=0
  file="$(mktemp "${TMPDIR:-/tmp}/zs_hosts.XXXXXX")" || {
    ZS_HOSTS_ERROR="mktemp failed"
    return 1
  }
  {
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    for i in "${!ZS_HOST_ADDRS[@]}"; do echo "${ZS_HOST_ADDRS[$i]} ${ZS_HOST_NAMES[$i]}"; done
  } >"$file"
  chmod 644 "$file"
  for i in "${!ZS_HOST_HOLDERS[@]}"; do
    _zs_hosts_err "could not mount a hosts file on host $i" \
      nsenter --target "${ZS_HOST_HOLDERS[$i]}" --mount -- mount --bind "$file" /etc/hosts ||
      { rc=1; break; }
  done
  # The mounts keep the file; its name is no longer needed.
  rm -f "$file"
  return $rc
}

# zs_hosts_mount_cgroups: each host sees this machine's cgroup filesystems
# under /sys/fs/cgroup (a host's /sys is its network namespace's own sysfs,
# with nothing mounted below it), mounted again as this namespace has them:
# the same types and options, so the same hierarchies (cgroup v1 or v2).
# For daemons that will not start without them (slurmd). Call after
# zs_hosts_setup. On failure sets ZS_HOSTS_ERROR and returns 1.
zs_hosts_mount_cgroups() {
  local i m src mp type opts rest mounts=()
  while read -r src mp type opts rest; do
    [[ "$mp" == /sys/fs/cgroup || "$mp" == /sys/fs/cgroup/* ]] && mounts+=("$src $mp $type $opts")
  done </proc/self/mounts
  if ((${#mounts[@]} == 0)); then
    ZS_HOSTS_ERROR="nothing is mounted on /sys/fs/cgroup here"
    return 1
  fi
  for i in "${!ZS_HOST_HOLDERS[@]}"; do
    for m in "${mounts[@]}"; do
      read -r src mp type opts <<<"$m"
      _zs_hosts_err "could not mount $type on $mp on host $i" \
        nsenter --target "${ZS_HOST_HOLDERS[$i]}" --mount -- \
        sh -c 'mkdir -p "$4" && mount -t "$2" -o "$3" "$1" "$4"' sh "$src" "$type" "$opts" "$mp" ||
        return 1
    done
  done
}
