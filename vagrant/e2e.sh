#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# e2e.sh [cluster-e2e.sh OPTIONS]: the cluster e2e (scripts/cluster-e2e.sh)
# on the Vagrant VMs. It runs on node0, as the MPI user, and reaches every
# node with vagrant/node-exec; the privileged reads use sudo. Run from the
# host, in any directory, after `vagrant up` (docs/vagrant.md).
set -euo pipefail
cd "$(dirname "$0")"
# A step's wait is in wall time, and each of its looks at a node is a
# vagrant ssh of seconds under software emulation: a resumed job seen
# exchanging again took 43 to 80 s there (the netns rig's default, 60 s,
# cut one off). The caller's --step-timeout, later, wins.
args=' --step-timeout 180'
for a in "$@"; do args+=" $(printf '%q' "$a")"; done
exec vagrant ssh node0 -c "bash /vagrant/scripts/cluster-e2e.sh --sudo --bin /vagrant/bin$args -- /vagrant/vagrant/node-exec -M {}"
