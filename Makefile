# SPDX-License-Identifier: Apache-2.0
# mpipause: make help lists the targets.

SHELL := /bin/bash
export PATH := $(PATH):/usr/local/go/bin
GO ?= go
BIN := $(CURDIR)/bin
# Privileged tests fail instead of skipping when this is set (internal/testutil).
PRIV := MPIPAUSE_REQUIRE_PRIV=1
GENERATED := loader/*_bpfel.go loader/*_bpfel.o
# Every Go package, module by module (go.work's): ./... stops at a directory
# with a go.mod of its own.
GOPKGS := ./... ./kernel-tests/... ./kernel-tests/tools/...
# The commands print the version the .deb and the man pages carry (--version).
VERSION_STR := $(shell scripts/version.sh)
STAMP := -X github.com/mpipause/mpipause/internal/version.stamped=$(VERSION_STR)

.DEFAULT_GOAL := help
.PHONY: help deps build generate check-generate check-format check-vagrant test-cluster-script test test-unit test-fuzz test-gen test-priv test-multinode test-security test-faults bench bench-base demo clean
.PHONY: man install uninstall deb check-install check-deb deb-for check-deb-for apps-for
.PHONY: check-systemd test-containers vagrant-prebuilt check-vagrant-boot check-vagrant-cluster check-vagrant-slurm check-vagrant-sbatch check-matrix

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

deps: ## install the Debian packages that are missing (root)
	@bash scripts/deps.sh

build: ## build bin/mpipause, bin/mpid, bin/rig, bin/libmpipause.so, bin/libucxfinalize.so, the MPI test apps, the fault tests' bin/test/mpid and the Slurm plugin bin/mpipause_spank.so
	@mkdir -p $(BIN)/test
	$(GO) build -ldflags "$(STAMP)" -o $(BIN)/ ./cmd/mpipause ./cmd/mpid ./kernel-tests/cmd/rig
	@# The fault tests' mpid: the failpoint hook is in this build only (internal/node/failpoints.go).
	$(GO) build -tags failpoints -ldflags "$(STAMP)" -o $(BIN)/test/ ./cmd/mpid
	$(MAKE) -s -C libmpi-shim OUT=$(BIN)
	$(MAKE) -s -C kernel-tests/ucx-finalize OUT=$(BIN)
	$(MAKE) -s -C kernel-tests/apps OUT=$(BIN)/apps
	@if [ -f /usr/include/slurm/spank.h ]; then $(MAKE) -s -C slurm OUT=$(BIN); \
		else echo "build: no /usr/include/slurm/spank.h (libslurm-dev): bin/mpipause_spank.so not built" >&2; fi

generate: ## regenerate BPF objects and Go bindings from bpf/*.c (needs clang)
	$(GO) generate ./loader/

check-generate: ## fail if regenerating BPF objects changes anything committed
	@bash scripts/check-generate.sh

# golangci-lint, pinned; built into bin/tools by the go command (from the
# module proxy, cached by the build cache), never part of a go.mod: its
# dependencies would join the workspace's.
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT := $(BIN)/tools/golangci-lint

$(GOLANGCI_LINT):
	@mkdir -p $(BIN)/tools
	GOBIN=$(BIN)/tools $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)

check-format: $(GOLANGCI_LINT) ## fail if a Go file is not gofmt-formatted, a C file of the shim (libmpi-shim/, its tests too) is not clang-format-formatted (libmpi-shim/.clang-format), go vet reports a problem, golangci-lint (.golangci.yml: the module boundaries) finds a product package importing the kernel tests, the rig or the tooling, the product module requires one of their modules, or a built program is tracked
	@f=$$("$$($(GO) env GOROOT)/bin/gofmt" -l $$(git ls-files '*.go')); \
		[ -z "$$f" ] || { echo "not gofmt-formatted: $$f (run: gofmt -w $$f)" >&2; exit 1; }
	@# The shim's C, by libmpi-shim/.clang-format (clang-format 14: another
	@# version lays some constructs out otherwise). A failure that names no
	@# file (no clang-format, a bad style file) prints what clang-format said.
	@command -v clang-format >/dev/null || { echo "no clang-format (make deps installs it)" >&2; exit 1; }
	@o=$$(clang-format --dry-run --Werror $$(git ls-files 'libmpi-shim/*.c' 'libmpi-shim/*.h') 2>&1) || { \
		f=$$(sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: error: code should be clang-formatted.*/\1/p' <<<"$$o" | sort -u | tr '\n' ' '); \
		[ -n "$$f" ] || { echo "$$o" >&2; exit 1; }; \
		echo "not clang-format-formatted: $${f% } (run: clang-format -i $${f% })" >&2; exit 1; }
	$(GO) vet $(GOPKGS)
	$(GO) vet -tags failpoints ./internal/node/ ./internal/mpid/ ./cmd/mpid/
	@# go.work resolves the other modules for any package, required or not:
	@# the linter's depguard rules keep the product's packages and tests
	@# from importing them (in workspace mode, where such an import would
	@# build), and these keep the product's go.mod from requiring them
	@# (directly or through another module) and its imports within it.
	$(GOLANGCI_LINT) run ./...
	@m=$$(GOWORK=off $(GO) list -m all | grep -E '/kernel-tests|gonum|vishvananda'); \
		[ -z "$$m" ] || { echo "the product module requires test or tooling modules: $$m" >&2; exit 1; }
	@GOWORK=off $(GO) list -test -deps ./... >/dev/null || { echo "the product module imports what its go.mod does not require" >&2; exit 1; }
	@# Built programs belong in bin/; the only ELF files tracked are the
	@# generated BPF objects (make check-generate rebuilds them).
	@e=$$(git ls-files -z | xargs -0 sh -c 'for f; do case $$f in *.o) continue;; esac; [ "$$(head -c4 "$$f" | od -An -c | tr -d " ")" = 177ELF ] && echo "$$f"; done; true' _); \
		[ -z "$$e" ] || { echo "built programs are tracked: $$e (git rm --cached them; make puts its output in bin/)" >&2; exit 1; }

# make test's tiers, in order; after each, its time (scripts/tier-clock.sh),
# and at the end all of them: what the CI budget is measured by.
TEST_TIERS := deps build check-generate check-format check-vagrant check-deb check-systemd test-unit test-fuzz test-priv test-kernels test-multinode test-security demo test-cluster-script check-vagrant-boot
TIER_CLOCK := $(BIN)/test-tiers.tsv
test: tier-clock-start $(foreach t,$(TEST_TIERS),$(t) tier-clock-$(t)) ## install what is missing and run every test tier, the demo included; prints each tier's time
	@bash scripts/tier-clock.sh $(TIER_CLOCK) report

tier-clock-start:
	@bash scripts/tier-clock.sh $(TIER_CLOCK) start
tier-clock-%:
	@bash scripts/tier-clock.sh $(TIER_CLOCK) $*

test-unit: ## tier 1: unit tests with every capability dropped (must pass unprivileged), and the shim's C tests
	env -u CI -u MPIPAUSE_REQUIRE_PRIV setpriv --inh-caps=-all --bounding-set=-all -- $(GO) test -count=1 $(GOPKGS)
	env -u CI -u MPIPAUSE_REQUIRE_PRIV setpriv --inh-caps=-all --bounding-set=-all -- $(GO) test -count=1 -tags failpoints -run Failpoint ./internal/node/
	setpriv --inh-caps=-all --bounding-set=-all -- $(MAKE) -s -C libmpi-shim OUT=$(BIN) test

# Every decoder of bytes from the network or another process, as package:target.
FUZZ_TARGETS := internal/ranks:FuzzParseHello internal/ranks:FuzzParseJoin internal/ranks:FuzzParseReply \
	internal/ranks:FuzzStatePage internal/ctl:FuzzReadRequest internal/ctl:FuzzDecodeReply \
	internal/mpid:FuzzDecodeControl quiesce:FuzzReadFrame quiesce:FuzzServeConn quiesce:FuzzReadHello quiesce:FuzzParseKeys
# A count, not a duration: Go 1.26 can fail a duration-bounded run with a bare
# "context deadline exceeded" when a worker is busy at the deadline
# (go.dev/issue/75804), which would be a CI failure with no input behind it.
FUZZ_TIME ?= 100000x

# The shim's generated programs at length (make test runs 50,000 within
# test-unit): GEN_PROGRAMS from GEN_SEED (the time if unset).
GEN_PROGRAMS ?= 1000000
test-gen: build ## the shim's generated torture programs (libmpi-shim/tests/gen_test.c), GEN_PROGRAMS (1,000,000) seeds from GEN_SEED, each a writing and a reading program; a failure prints its seed and the command that reruns it (not in make test)
	@setpriv --inh-caps=-all --bounding-set=-all -- $(MAKE) -s -C libmpi-shim OUT=$(BIN) gen-test GEN_PROGRAMS=$(GEN_PROGRAMS) GEN_SEED=$(GEN_SEED)

test-fuzz: ## fuzz every decoder FUZZ_TIME (100000 inputs) each, and the shim's with libFuzzer, unprivileged; new failures land in testdata/fuzz
	@for t in $(FUZZ_TARGETS); do \
		echo "fuzz $${t%%:*} $${t##*:} for $(FUZZ_TIME)"; \
		env -u CI -u MPIPAUSE_REQUIRE_PRIV setpriv --inh-caps=-all --bounding-set=-all -- \
			$(GO) test -run '^$$' -fuzz "^$${t##*:}$$" -fuzztime $(FUZZ_TIME) ./$${t%%:*}/ > /tmp/mpipause-fuzz.log 2>&1 \
			|| { grep -v '^fuzz: elapsed' /tmp/mpipause-fuzz.log | tail -20; exit 1; }; \
	done
	@echo "fuzz libmpi-shim request decoder (libFuzzer)"
	@setpriv --inh-caps=-all --bounding-set=-all -- $(MAKE) -s -C libmpi-shim OUT=$(BIN) fuzz

# One package at a time (-p 1): privileged tests share the machine's bpffs
# mounts, pins and cgroup trees, and a package that checks them (no pin
# left by a refused `mpipause observe`) saw another package's pins appear.
test-priv: ## tier 2: privileged kernel tests (BPF, sock_diag, cgroups, netns, the rig's own); fail, not skip, without root
	$(PRIV) $(GO) test -p 1 -count=1 -timeout 15m ./loader/... ./internal/... ./cmd/... ./kernel-tests/internal/... ./kernel-tests/cmd/...

test-multinode: build ## tier 3: real Open MPI and MPICH jobs on the netns rig
	$(PRIV) MPIPAUSE_BIN=$(BIN) $(GO) test -count=1 -timeout 50m -v -skip '^TestSecurity$$' ./kernel-tests/ 2>&1 | tee /tmp/mpipause-multinode.log | grep -E '^(=== RUN|--- |PASS|FAIL|ok|panic)|_test.go:'; exit $${PIPESTATUS[0]}

test-security: build ## tier 4: each attack of docs/security.md's table as uid 1001 against uid 1002's job on the rig, judged on the victim; prints attack x outcome
	$(PRIV) MPIPAUSE_BIN=$(BIN) $(GO) test -count=1 -timeout 20m -v -run '^TestSecurity$$' ./kernel-tests/ 2>&1 \
		| tee /tmp/mpipause-security.log | grep -E '^(--- |PASS|FAIL|ok|panic)|security [|]|security[a-z_]*_test.go:'; exit $${PIPESTATUS[0]}

.PHONY: check-unit
check-unit: build ## systemd-analyze verify dist/systemd/mpid.service offline (no running systemd needed); also in test-multinode
	$(PRIV) MPIPAUSE_BIN=$(BIN) $(GO) test -count=1 -v -run '^TestMPIDUnitVerifies$$' ./kernel-tests/ | grep -E '^(--- |ok|FAIL)|_test.go:'; exit $${PIPESTATUS[0]}

# MPIPAUSE_FAULT_TRIALS in the environment counts as FAULT_TRIALS, so that a
# replay line the fault table prints runs one trial as it says.
FAULT_TRIALS ?= $(or $(MPIPAUSE_FAULT_TRIALS),5)
test-faults: build ## the fault table: each fault injected FAULT_TRIALS (5) times in each pause phase on the rig, outcomes counted (also in test-multinode, 2 times); MPIPAUSE_FAULT_ONLY, _SEED, _LIB replay one trial
	$(PRIV) MPIPAUSE_BIN=$(BIN) MPIPAUSE_FAULT_TRIALS=$(FAULT_TRIALS) $(GO) test -count=1 -timeout 60m -v -run '^TestFaultTable$$' ./kernel-tests/ 2>&1 \
		| tee /tmp/mpipause-faults.log | grep -E '^(--- |PASS|FAIL|ok|panic)|faults ?[:|]' | sed 's/^ *faulttable_test.go:[0-9]*: //'; exit $${PIPESTATUS[0]}

# 22 cells (fault x phase) x 44 trials and 4 cells of the rows that wait
# out a deadline (6 to 11 s a trial) x 11 = 1,012 faults, each cell's trials
# half on Open MPI, half on MPICH. The log of each run is kept apart
# (/tmp/mpipause-faults-long.<time>.log), not overwritten by the next run.
FAULT_LONG_TRIALS ?= 44
.PHONY: test-faults-long
test-faults-long: build ## the fault table with FAULT_LONG_TRIALS (44) trials per cell (a quarter in rows that wait out a deadline), both MPI libraries in each: 1,012 faults, about 35 minutes (not in make test); prints a replay line per trial not allowed
	@log=/tmp/mpipause-faults-long.$$(date +%Y%m%d-%H%M%S).log; echo "test-faults-long: the whole log in $$log"; \
	$(PRIV) MPIPAUSE_BIN=$(BIN) MPIPAUSE_FAULT_TRIALS=$(FAULT_LONG_TRIALS) MPIPAUSE_FAULT_LIB=both $(GO) test -count=1 -timeout 5h -v -run '^TestFaultTable$$' ./kernel-tests/ 2>&1 \
		| tee $$log | grep -E '^(--- |PASS|FAIL|ok|panic)|faults ?[:|]' | sed 's/^ *faulttable_test.go:[0-9]*: //'; exit $${PIPESTATUS[0]}

check-vagrant: ## vagrant validate of vagrant/Vagrantfile, libvirt and virtualbox (offline, leaves nothing), boot-check.sh's test of which guest panics are the emulator's, and shellcheck of the cluster scripts
	@bash vagrant/validate.sh
	shellcheck scripts/cluster-e2e.sh scripts/demo.sh vagrant/provision.sh vagrant/provision-kernel.sh vagrant/node-exec vagrant/e2e.sh vagrant/rig-ssh-check.sh vagrant/validate.sh kernel-tests/containers/crig.sh \
		vagrant/build-box.sh vagrant/box-boot.sh vagrant/libvirt-host.sh vagrant/boot-check.sh vagrant/qemu-tcg vagrant/provision-slurm.sh vagrant/slurm-e2e.sh vagrant/scope-e2e.sh vagrant/e2e-lib.sh \
		kernel-tests/kernels/boot.sh scripts/deb.sh scripts/deb-for.sh scripts/check-deb-for.sh scripts/apps-for.sh scripts/release-root.sh scripts/tier-clock.sh vagrant/matrix.sh

# The loader's tests on Debian's own kernels (docs/kernels.md): each suite's
# linux-image-amd64 booted under QEMU (software emulation) with an initramfs
# that runs the static test binary as root. KERNEL_TESTS is -test.run's
# regexp; the console of each boot goes to KERNEL_LOGS/kernels-SUITE.log.
KERNEL_SUITES ?= bullseye bookworm trixie
KERNEL_TESTS ?= .
KERNEL_TIMEOUT ?= 2400
KERNEL_LOGS ?= $(BIN)/kernels
# More options of boot.sh for every boot, e.g. --memlock unlimited.
KERNEL_BOOT_FLAGS ?=
.PHONY: check-kernels test-kernels
test-kernels: ## the loader's tests on the floor kernel, Debian 11's 5.10, under QEMU (check-kernels KERNEL_SUITES=bullseye; root)
	@$(MAKE) -s check-kernels KERNEL_SUITES=bullseye


check-kernels: ## the loader's tests (KERNEL_TESTS, a -test.run regexp: all) as root on the Debian kernels of KERNEL_SUITES (bullseye 5.10, bookworm 6.1, trixie 6.12) under QEMU, no disk image; prints suite x kernel x BTF x passed/failed (root; make test runs the floor's, test-kernels)
	@mkdir -p $(BIN)/kernels $(KERNEL_LOGS)
	@# Static: the guest has no libraries for it.
	CGO_ENABLED=0 $(GO) test -c -o $(BIN)/kernels/loader.test ./loader/
	@rc=0; res=$(BIN)/kernels/results; : >$$res; \
	for s in $(KERNEL_SUITES); do \
		log=$(KERNEL_LOGS)/kernels-$$s.log; rm -f $$log; \
		kernel-tests/kernels/boot.sh --suite $$s --timeout $(KERNEL_TIMEOUT) --log $$log --with loader/testdata $(KERNEL_BOOT_FLAGS) -- \
			$(BIN)/kernels/loader.test -test.v -test.count=1 -test.timeout $$(( $(KERNEL_TIMEOUT) - 120 ))s -test.run '$(value KERNEL_TESTS)' || rc=1; \
		grep '^boot.sh: result ' $$log | tail -1 >>$$res || echo "boot.sh: result suite=$$s rc=no-result" >>$$res; \
	done; \
	echo; echo "check-kernels: loader tests (-test.run '$(value KERNEL_TESTS)'); logs in $(KERNEL_LOGS)/kernels-SUITE.log"; \
	awk 'BEGIN { printf "%-10s %-24s %-4s %6s %6s %7s %7s %7s  %s\n", "suite", "kernel", "BTF", "boot", "run", "passed", "failed", "skipped", "exit" } \
		{ delete f; for (i = 3; i <= NF; i++) { split($$i, kv, "="); f[kv[1]] = kv[2] } \
		  printf "%-10s %-24s %-4s %6s %6s %7s %7s %7s  %s\n", f["suite"], f["kernel"], f["btf"], f["boot"], f["run"], f["passed"], f["failed"], f["skipped"], f["rc"] }' $$res; \
	exit $$rc

# What the VMs install instead of building (vagrant/provision.sh's tools and
# install steps): the .deb of this tree, and the test apps the cluster e2e
# runs (bin/ is not synced to the VMs; vagrant/.prebuilt/ is, gitignored).
vagrant-prebuilt: build deb ## copy the .deb, bin/apps and bin/libucxfinalize.so to vagrant/.prebuilt/: Vagrant provisioning installs them, building nothing in the VMs
	@rm -rf vagrant/.prebuilt && mkdir vagrant/.prebuilt
	cp $(BIN)/mpipause_$(VERSION_STR)_$$(dpkg --print-architecture).deb $(BIN)/libucxfinalize.so vagrant/.prebuilt/
	cp -r $(BIN)/apps vagrant/.prebuilt/apps
	echo bookworm >vagrant/.prebuilt/release

check-vagrant-slurm: vagrant-prebuilt ## on the 3 Vagrant VMs: Slurm with cgroup confinement (proctrack/cgroup, task/cgroup, cgroup/v2): scontrol suspend/resume, preemption (SUSPEND,GANG), then scancel, time limit, memory limit, sstat, sacct, --cpu-bind with mpipause as without; and a job in a systemd scope with MemoryMax (root; not in make test: check-vagrant-boot runs its suspends)
	@bash vagrant/boot-check.sh --slurm --no-e2e

check-vagrant-sbatch: vagrant-prebuilt ## on the 3 Vagrant VMs with Slurm: Open MPI's mpirun and MPICH's mpiexec inside sbatch scripts, scontrol suspend and resume, with mpid given CAP_DAC_OVERRIDE as docs/slurm.md says (root; not in make test)
	@bash vagrant/boot-check.sh --slurm --no-e2e --sbatch

# Not in make test: three clusters one after the other, about 85 minutes (docs/vagrant.md).
MATRIX_SUITES ?= bullseye bookworm-stock trixie
check-matrix: build ## the distribution matrix: for each of MATRIX_SUITES (Debian 11 with 5.10, 12 with its 6.1, 13 with 6.12 and Slurm 24.11), 3 VMs of that release with its own .deb and apps, mpid check, the cluster e2e with both libraries, on 13 the Slurm, scope and sbatch e2e; one table (vagrant/matrix.sh; root)
	@bash vagrant/matrix.sh --suites "$(MATRIX_SUITES)"

# make test's VM tier is what only VMs show: the box boots, provisions and
# passes mpid check, and Slurm's own cgroup/v2 confinement suspends each
# library's job through mpipause, every VM's connections read from its own
# kernel. The rest of Slurm's checks are check-vagrant-slurm's and the
# cluster e2e on VMs check-vagrant-cluster's (the same script runs on the rig
# in test-cluster-script): under CI's emulation the whole of them took over
# 50 minutes, and make test must end within CI's 90.
check-vagrant-boot: vagrant-prebuilt ## the 3-VM Vagrant cluster booted under vagrant-libvirt from the box vagrant/build-box.sh builds, provisioned, checked over vagrant ssh, Slurm with cgroup confinement on it: each library's job suspended by scontrol until one pause is clean, every VM's connections empty, resumed to the unpaused result (slurm-e2e.sh --only suspend); destroyed, nothing left (root)
	@bash vagrant/boot-check.sh --no-e2e --slurm-suspends

check-vagrant-cluster: vagrant-prebuilt ## on the 3 Vagrant VMs: the cluster e2e (vagrant/e2e.sh, both libraries, 2 pauses each; root; not in make test)
	@bash vagrant/boot-check.sh

# The cluster e2e script (what vagrant/e2e.sh runs on the VMs) on a 3-node
# netns rig of its own (not test-multinode's).
CLUSTER_RIG ?= kvag
test-cluster-script: build ## the cluster e2e script of vagrant/ (docs/vagrant.md) on a 3-node netns rig: Open MPI and MPICH jobs paused, checked on every node
	@export MPIPAUSE_RIG=$(CLUSTER_RIG); kernel-tests/rig up 3 >/dev/null || { kernel-tests/rig down >/dev/null; exit 1; }; \
		bash scripts/cluster-e2e.sh -- kernel-tests/rig exec {} --; rc=$$?; \
		kernel-tests/rig down >/dev/null || rc=1; exit $$rc

# The cluster e2e script on the container rig (docs/containers.md): 3
# systemd-nspawn nodes booting Debian 12, mpipause from the .deb, provisioned
# by vagrant/provision.sh, mpid by its unit.
CONTAINER_RIG ?= ctest
test-containers: build deb ## the cluster e2e script of vagrant/ on 3 systemd-nspawn containers (Debian 12, the .deb, vagrant/provision.sh, mpid by its unit)
	@export MPIPAUSE_CRIG=$(CONTAINER_RIG); kernel-tests/containers/crig.sh up 3 || { kernel-tests/containers/crig.sh down; exit 1; }; \
		bash scripts/cluster-e2e.sh -- kernel-tests/containers/crig.sh exec {} --; rc=$$?; \
		kernel-tests/containers/crig.sh down || rc=1; exit $$rc

BENCH_DIR ?= bench-results
# BASE_SHIM: another build's libmpipause.so, measured beside this one's by the
# overhead step's calls (docs/benchmarks.md, "Producing the figures").
BASE_SHIM ?=
BENCH_ENV = $(PRIV) MPIPAUSE_BIN=$(BIN) MPIPAUSE_BENCH_DIR=$(abspath $(BENCH_DIR)) \
	$(if $(BASE_SHIM),MPIPAUSE_BENCH_BASE_SHIM=$(abspath $(BASE_SHIM)))
bench: deps build ## the benchmark suite (not in make test, ~20 min when last timed): prints one table; CSV and SVG plots in BENCH_DIR (bench-results); BASE_SHIM=<.so> adds that shim to the per-call costs
	@rm -rf $(BENCH_DIR) && mkdir -p $(BENCH_DIR); rc=0; \
	step() { echo "bench: $$1" >&2; shift; "$$@" 2>&1 | tee -a $(BENCH_DIR)/bench.log | { grep -E '^(Benchmark|--- FAIL|FAIL|panic|bench: |pause |overhead |snapshot |scale |placement )|_test.go:' || true; }; \
		[ $${PIPESTATUS[0]} -eq 0 ] || { echo "bench: that step FAILED (see $(BENCH_DIR)/bench.log)" >&2; rc=1; }; }; \
	step "coordination at scale (quiesce, 16 to 4096 simulated nodes)" \
		env $(BENCH_ENV) $(GO) test -run '^$$' -bench '^BenchmarkScale$$' -benchtime 1x -timeout 20m ./quiesce/; \
	step "observer snapshot cost (100 to 10,000 sockets)" \
		env $(BENCH_ENV) $(GO) test -run '^$$' -bench '^BenchmarkSnapshot$$' -benchtime 20x -timeout 20m ./loader/; \
	step "the figures of those two, from scale.csv and snapshot.csv (the product module draws none)" \
		$(GO) run ./kernel-tests/tools/bench/benchplot $(BENCH_DIR); \
	step "a drain check with map iterators refused: a walk against a recheck (3 and 48 connections)" \
		env $(BENCH_ENV) $(GO) test -run '^$$' -bench '^BenchmarkRecheck$$' -benchtime 20x -timeout 20m ./loader/; \
	step "steady-state overhead of shim and BPF (ping-pong on the rig)" \
		env $(BENCH_ENV) $(GO) test -run '^$$' -bench '^BenchmarkOverhead$$' -benchtime 1x -timeout 30m ./kernel-tests/; \
	step "pause with ranks placed inside their launcher's scopes (inner) beside mpid's own cgroups (created), alternated" \
		env $(BENCH_ENV) $(GO) test -run '^$$' -bench '^BenchmarkPlacement$$' -benchtime 1x -timeout 30m ./kernel-tests/; \
	step "pause and resume beside SIGSTOP and cgroup freeze (rig, 12 jobs)" \
		env $(BENCH_ENV) MPIPAUSE_RIG_NODES=4 $(GO) test -run '^$$' -bench '^BenchmarkPause$$' -benchtime 1x -timeout 60m ./kernel-tests/; \
	$(GO) run ./kernel-tests/tools/bench/benchtable $(BENCH_DIR) || rc=1; \
	exit $$rc

# The shim of git revision BASE is built from that revision's libmpi-shim/
# (git archive: the worktree is not touched) into BENCH_DIR, where it stays
# beside the figures it gave. Without a job mode in CALL_MODES a round takes
# about 2 s, and other checkouts' jobs on the machine do not hold it back
# (docs/benchmarks.md, "Producing the figures").
BASE ?=
CALL_RUNS ?= 100
CALL_MODES ?= plain,shim,base
bench-base: deps build ## the shim's per-call cost, this build's against revision BASE's in the same run, CALL_RUNS (100) rounds of CALL_MODES, and both send wrappers' open-gate path
	@[ -n "$(BASE)" ] || { echo "bench-base: name the baseline: make bench-base BASE=<git revision>" >&2; exit 2; }
	@rev=$$(git rev-parse --short --verify '$(BASE)^{commit}') || exit 2; \
	rm -rf $(BENCH_DIR) && mkdir -p $(BENCH_DIR)/base-$$rev || exit 1; \
	src=$$(mktemp -d) && trap 'rm -rf "$$src"' EXIT && \
	git archive $$rev libmpi-shim | tar -x -C "$$src" && \
	$(MAKE) -s -C "$$src/libmpi-shim" OUT=$(abspath $(BENCH_DIR))/base-$$rev $(abspath $(BENCH_DIR))/base-$$rev/libmpipause.so || exit 1; \
	echo "bench-base: the send wrappers' open-gate path, $$rev's shim, then this build's" >&2; \
	scripts/shim-fastpath.sh $(BENCH_DIR)/base-$$rev/libmpipause.so $(BIN)/libmpipause.so | tee $(BENCH_DIR)/fastpath.txt | grep -E '^(==|[a-z]+: )'; \
	[ $${PIPESTATUS[0]} -eq 0 ] || exit 1; \
	echo "bench-base: per-call cost, $$rev's shim and this build's, $(CALL_RUNS) rounds of $(CALL_MODES)" >&2; \
	env $(PRIV) MPIPAUSE_BIN=$(BIN) MPIPAUSE_BENCH_DIR=$(abspath $(BENCH_DIR)) MPIPAUSE_BENCH_CALL_RUNS=$(CALL_RUNS) MPIPAUSE_BENCH_CALL_MODES=$(CALL_MODES) \
		MPIPAUSE_BENCH_BASE_SHIM=$(abspath $(BENCH_DIR))/base-$$rev/libmpipause.so \
		$(GO) test -run '^$$' -bench '^BenchmarkOverhead$$/^calls$$' -benchtime 1x -timeout $$(( $(CALL_RUNS) + 5 ))m ./kernel-tests/ 2>&1 \
		| tee $(BENCH_DIR)/bench.log | { grep -E '^(Benchmark|--- FAIL|FAIL|panic|overhead )|_test.go:' || true; }; \
	rc=$${PIPESTATUS[0]}; $(GO) run ./kernel-tests/tools/bench/benchtable $(BENCH_DIR) || rc=1; exit $$rc

demo: deps build ## on a local 3-node rig: launch a real MPI job, pause it (kernel-verified), resume it, same result
	@bash scripts/demo.sh

clean: ## remove build output
	rm -rf $(BIN)

# Where make install puts things (docs/install.md); make deb uses the defaults.
PREFIX ?= /usr
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
SBINDIR ?= $(PREFIX)/sbin
# mpipause run looks for the shim in ../lib/mpipause beside its own binary.
SHIMDIR ?= $(PREFIX)/lib/mpipause
MANDIR ?= $(PREFIX)/share/man
SYSCONFDIR ?= /etc
# systemd reads /usr/local/lib/systemd/system too: a /usr/local install
# stays out of the package manager's /lib.
UNITDIR ?= $(if $(filter /usr,$(PREFIX)),/lib/systemd/system,$(PREFIX)/lib/systemd/system)
# Installed binaries are hardened as Debian's are: PIE, RELRO, bind now.
INSTALL_GOFLAGS ?= -buildmode=pie -ldflags="-bindnow $(STAMP)"
# The man pages' date: the last commit's (in a tarball, VERSION's), never the clock's.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || stat -c %Y VERSION)

man: ## build mpipause and mpid, and their man pages from what they print for --help (bin/man)
	@mkdir -p $(BIN)
	$(GO) build $(INSTALL_GOFLAGS) -o $(BIN)/ ./cmd/mpipause ./cmd/mpid
	@rm -rf $(BIN)/man
	SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(GO) run ./kernel-tests/tools/manpage/cmd/genman -o $(BIN)/man -version "$$(scripts/version.sh)" $(BIN)
	gzip -9n -k $(BIN)/man/mpipause.1 $(BIN)/man/mpid.8

install: man ## install the commands, the shim (and Slurm plugin), mpid's unit and config, the man pages (PREFIX=/usr, DESTDIR); keeps an existing config
	$(MAKE) -s -C libmpi-shim OUT=$(BIN)
	install -D -m 0755 $(BIN)/mpipause $(DESTDIR)$(BINDIR)/mpipause
	install -D -m 0755 $(BIN)/mpid $(DESTDIR)$(SBINDIR)/mpid
	install -D -m 0644 $(BIN)/libmpipause.so $(DESTDIR)$(SHIMDIR)/libmpipause.so
	install -D -m 0644 $(BIN)/man/mpipause.1.gz $(DESTDIR)$(MANDIR)/man1/mpipause.1.gz
	install -D -m 0644 $(BIN)/man/mpid.8.gz $(DESTDIR)$(MANDIR)/man8/mpid.8.gz
	@# The Slurm SPANK plugin (slurm/; it needs spank.h, from libslurm-dev), beside the shim it gives the ranks.
	@if [ -f slurm/Makefile ] && [ -f /usr/include/slurm/spank.h ]; then \
		$(MAKE) -s -C slurm OUT=$(BIN) && echo "install -D -m 0644 $(BIN)/mpipause_spank.so $(DESTDIR)$(SHIMDIR)/mpipause_spank.so" && \
		install -D -m 0644 $(BIN)/mpipause_spank.so $(DESTDIR)$(SHIMDIR)/mpipause_spank.so; \
	elif [ -f slurm/Makefile ]; then echo "install: no Slurm SPANK plugin: it needs /usr/include/slurm/spank.h (apt-get install libslurm-dev)" >&2; fi
	@# The unit names /usr/sbin/mpid: where this install put it instead.
	install -d $(DESTDIR)$(UNITDIR)
	sed 's|/usr/sbin/mpid|$(SBINDIR)/mpid|g' dist/systemd/mpid.service > $(DESTDIR)$(UNITDIR)/mpid.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/mpid.service
	@conf=$(DESTDIR)$(SYSCONFDIR)/mpipause/mpid.conf; \
	if [ -e $$conf ]; then echo "install: kept $$conf as it is (the shipped one is dist/mpid.conf)"; \
	else echo "install -D -m 0644 dist/mpid.conf $$conf"; install -D -m 0644 dist/mpid.conf $$conf; fi
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@if [ -z "$(DESTDIR)" ] && [ ! -e $(SYSCONFDIR)/mpipause/cluster.key ]; then \
		echo "install: mpid needs a cluster key: 'mpid keygen' on one node, copy $(SYSCONFDIR)/mpipause/cluster.key to every node (mode 0600), then 'systemctl enable --now mpid'"; fi

uninstall: ## remove what make install installed (same PREFIX, DESTDIR); keeps a changed config and the cluster key
	@# An enabled unit would leave a dangling link behind (systemctl disable works without systemd running).
	@if [ -z "$(DESTDIR)" ] && [ -e $(UNITDIR)/mpid.service ] && command -v systemctl >/dev/null; then \
		if [ -d /run/systemd/system ]; then systemctl disable --now mpid.service; else systemctl disable mpid.service; fi; fi
	rm -f $(DESTDIR)$(BINDIR)/mpipause $(DESTDIR)$(SBINDIR)/mpid $(DESTDIR)$(SHIMDIR)/libmpipause.so $(DESTDIR)$(SHIMDIR)/mpipause_spank.so \
		$(DESTDIR)$(MANDIR)/man1/mpipause.1.gz $(DESTDIR)$(MANDIR)/man8/mpid.8.gz $(DESTDIR)$(UNITDIR)/mpid.service
	@rmdir $(DESTDIR)$(SHIMDIR) 2>/dev/null || true
	@conf=$(DESTDIR)$(SYSCONFDIR)/mpipause/mpid.conf; \
	if [ -e $$conf ] && cmp -s $$conf dist/mpid.conf; then echo "rm -f $$conf"; rm -f $$conf; \
	elif [ -e $$conf ]; then echo "uninstall: kept $$conf: it differs from dist/mpid.conf"; fi; \
	rmdir $(DESTDIR)$(SYSCONFDIR)/mpipause 2>/dev/null || true
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

deb: ## bin/mpipause_VERSION_ARCH.deb, from make install into a staging directory (VERSION: scripts/version.sh)
	@bash scripts/deb.sh

# The .deb for one Debian release, or several (SUITE="bullseye bookworm trixie").
SUITE ?= bookworm
deb-for: ## bin/deb-SUITE/mpipause_VERSION_ARCH.deb for Debian SUITE (bullseye, bookworm, trixie): the shim and Slurm plugin compiled in a build root of that release, its Depends from it (root)
	@for s in $(SUITE); do bash scripts/deb-for.sh $$s || exit 1; done

apps-for: ## bin/apps-SUITE/: the MPI test programs and libucxfinalize.so compiled in a build root of Debian SUITE against its Open MPI and MPICH, for that release's VMs (root)
	@for s in $(SUITE); do bash scripts/apps-for.sh $$s || exit 1; done

check-deb-for: deb-for ## make deb-for's .deb of SUITE installs with apt on a fresh root of that release (mmdebstrap), works, and purges clean (root)
	@for s in $(SUITE); do bash scripts/check-deb-for.sh $$s || exit 1; done

check-install: ## make install DESTDIR=tmp installs exactly the expected files; uninstall removes them; the man pages lint clean
	@bash scripts/check-install.sh

check-deb: check-install deb ## the .deb passes lintian, installs with apt on a fresh Debian 12 (debootstrap), works, and purges clean
	@bash scripts/check-deb.sh

check-systemd: build deb ## mpid's unit, sandbox and all, under a real systemd (systemd-nspawn boots a fresh Debian 12): start, a 2-rank job paused and resumed, stop
	@bash scripts/check-systemd.sh
