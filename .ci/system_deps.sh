#!/usr/bin/env bash
# Debian packages the test suite needs beyond Python: a real single-node Slurm (slurmctld, slurmd,
# the client commands) and munge for its authentication (tests/slurm_cluster.py starts them on
# localhost), and iproute2 (`ip netns`: the two-host weight-sync test builds two network namespaces).
# Idempotent and quiet: does nothing when the binaries are already there; the packages' own
# service-start step is refused inside containers, which is harmless (the tests start the daemons
# themselves with their own configuration).
set -euo pipefail
need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps.sh: no apt-get; install ${need[*]} yourself (the Slurm tests skip without them)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo -n"
    if ! sudo -n true 2>/dev/null; then  # a user without root: say what is missing and what it costs
        echo "system_deps.sh: not root and no password-less sudo; install ${need[*]} yourself" \
             "(without them the Slurm and multi-host tests skip, nothing else)" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
# policy-rc.d 101 = "do not start services": the postinst steps would try and fail harmlessly anyway.
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
    # a failing service start leaves packages half-configured; configure them without it
    $SUDO dpkg --configure -a >/dev/null 2>&1 || true
}
for bin in slurmctld slurmd sbatch munged ip; do
    command -v "$bin" >/dev/null 2>&1 || { echo "system_deps.sh: $bin still missing after apt-get" >&2; exit 1; }
done
