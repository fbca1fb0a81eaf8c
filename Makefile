# The two commands of the README do all the set-up on a fresh Debian/Ubuntu machine:
#   make conformance   run the catalogue against every driver that can run here
#   make test          the suite's own tests (lint, types, self-tests)
SHELL := /bin/bash
# The venv's Python: the system's, which a root-run reference sandbox's unprivileged user can
# read (a Python under /root it cannot), unless PYTHON names another.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV := .venv
BIN := $(VENV)/bin
SIM_ROOT ?= /run/gpu-sandbox-sim
SIM_GPUS ?= 8
# The simulated host of `make conformance`: two of its GPUs in MIG mode, and an Intel and
# two AMD GPUs beside them, so that the MIG and DRI requirements are checked too.
SIM_MIG ?= 0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb
SIM_DRI ?= intel:1,amd:2
REPORTS := reports
PYTEST_ARGS ?=
# How many lanes make conformance runs at once on a simulated host (docs/benchmarks.md).
LANE_JOBS ?= 2

ENGINES := scripts/engines.sh
VM_IMAGE := scripts/vm-image.sh
VM_IMAGE_ENV = env $$(sed 's/^/GPU_SANDBOX_VM_IMAGE=/' .vm-image 2>/dev/null)
CLUSTER := scripts/cluster.sh

.PHONY: conformance test test-stress lint bench bench-engines bench-workloads venv host-packages \
	test-packages simulated-host engines engines-stop clean vm-image vm-lane bench-vm \
	cluster cluster-stop job-image

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get -o DPkg::Lock::Timeout=300 update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq python3-venv >/dev/null; \
	  else \
	    echo "$(PYTHON) cannot make a venv: sudo apt-get install python3-venv, or make PYTHON=..." >&2; exit 1; \
	  fi; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,docker,podman,kubernetes]'
	touch $@

# torch for the workload payloads' CPU self-check, pinned to an exact version: this
# machine kind's pip finds a CPU build of it on disk, while an unpinned `torch` (or a range)
# would resolve to the CUDA build and several GB of wheels. GPU runners install the `gpu`
# extra instead. Elsewhere, point TORCH at a CPU wheel.
TORCH ?= torch==2.13.0
$(BIN)/.torch: $(BIN)/.installed
	$(BIN)/pip install --quiet '$(TORCH)'
	touch $@

venv: $(BIN)/.installed $(BIN)/.torch

# Installs from Debian, as root, each package of $(1) ("command:package", or
# "command+other-command:package") when none of its commands is found; otherwise prints the
# apt-get line to run, and fails. Waits for another apt to finish.
define install-missing
	@missing=""; \
	for need in $(1); do \
	  cmds="$${need%%:*}"; found=""; \
	  for cmd in $${cmds//+/ }; do command -v "$$cmd" >/dev/null && found=1; done; \
	  [ -n "$$found" ] || missing="$$missing $${need#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing from Debian"; \
	    apt-get -o DPkg::Lock::Timeout=300 update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq $$missing >/dev/null; \
	  else \
	    echo "missing host packages:$$missing; install them with: sudo apt-get install$$missing" >&2; \
	    exit 1; \
	  fi; \
	fi
endef

# bubblewrap runs the reference driver's sandboxes; busybox-static lets the self-tests run
# the simulated nvidia-smi under busybox as a container image would; jq runs the lease
# protocol's sh client (gpuhost/gpu-lease), which holds GPUs in GPU-HOSTWIDE-01.
host-packages:
	$(call install-missing,bwrap:bubblewrap /bin/busybox:busybox-static nsenter+flock:util-linux jq:jq)

# chromium renders the HTML conformance matrix in the self-tests, headless (GitHub's Ubuntu
# runners have Google Chrome instead).
test-packages:
	$(call install-missing,chromium+chromium-browser+google-chrome:chromium)

# A simulated host that stays until `python -m gpuhost.simulated teardown --root $(SIM_ROOT)`,
# for runs of your own with --sim-root; `make conformance` makes one per run instead.
simulated-host: venv
	@if nvidia-smi -L >/dev/null 2>&1; then \
	  echo "real NVIDIA GPUs found: no simulated host"; \
	else \
	  $(BIN)/python -m gpuhost.simulated setup --root $(SIM_ROOT) --count $(SIM_GPUS) \
	    --mig=$(SIM_MIG) --dri=$(SIM_DRI) --cdi-dir /var/run/cdi; \
	fi

# The container engines of the docker and podman lanes: installed from Debian when missing
# (root), started in the background unless they already answer. `make engines-stop` stops
# what `make engines` started, by pid. `make conformance` never installs them.
engines: host-packages
	@$(ENGINES) install
	@$(ENGINES) start >/dev/null

engines-stop:
	@$(ENGINES) stop

# The kubernetes lane's single-node cluster (scripts/cluster.sh), as root: its packages from
# Debian when missing, Kubernetes 1.20.2 built once from Debian's source package and cached
# in /var/cache/gpu-sandbox/kubernetes (~5 min cold, seconds warm), then started under
# /run/gpu-sandbox-cluster with two simulated GPU hosts and their device plugins, unless it
# already answers. kubectl: /run/gpu-sandbox-cluster/bin/kubectl --kubeconfig
# /run/gpu-sandbox-cluster/kubeconfig. `make cluster-stop` stops it and undoes its changes.
# `make conformance` runs the kubernetes lane when a cluster answers (this one, or yours
# through KUBECONFIG), and otherwise reports it skipped with what it needed.
cluster: $(BIN)/.installed
	@$(CLUSTER) install
	@$(CLUSTER) start

cluster-stop:
	@$(CLUSTER) stop

# The catalogue's own image, for running it as a Job on each GPU node (python -m
# conformance.job; docs/drivers/kubernetes.md): built from this machine's Python and the
# project (scripts/cluster/job_image.py), imported into every node of the local cluster.
JOB_IMAGE := build/gpu-sandbox-catalogue.oci.tar
job-image: venv cluster
	@mkdir -p build
	@$(BIN)/python scripts/cluster/job_image.py \
	  --name docker.io/library/gpu-sandbox-catalogue:latest --out $(JOB_IMAGE)
	@$(CLUSTER) import-image $(JOB_IMAGE)

# The vm lane's QEMU and guest image (scripts/vm-image.sh): QEMU, cpio, busybox-static and
# lz4 from Debian when missing (root), Debian's cloud kernel extracted (never installed) and
# a busybox initramfs built into /var/cache/gpu-sandbox/vm, cached by versions.
# The image built for this checkout's guest is the one its runs use (GPU_SANDBOX_VM_IMAGE), not
# the cache's `current`, which a checkout of another guest may point elsewhere meanwhile.
vm-image:
	@$(VM_IMAGE) install
	@$(VM_IMAGE) build > .vm-image

# `make conformance` sets the vm lane up as root; otherwise the driver's probe skips the lane
# with what it needed and the command to run. A failed set-up is the probe's to report.
vm-lane:
	@if [ "$$(id -u)" = 0 ]; then $(MAKE) --no-print-directory vm-image || true; fi

# Prints the matrix and one verdict per driver; writes the reports (README: Reports). A real
# GPU (nvidia-smi lists one) is used as it is, by one pytest run; otherwise each lane (driver)
# is a run of its own with a simulated host of its own (--sim-gpus), registered with the
# container engines and removed at its end, LANE_JOBS lanes at once (python -m
# conformance.lanes: each lane's output in reports/lanes/), their reports merged.
conformance: venv host-packages vm-lane gosandbox
	@mkdir -p $(REPORTS)
	@sim=""; nvidia-smi -L >/dev/null 2>&1 || \
	  sim="--sim-gpus=$(SIM_GPUS) --sim-mig=$(SIM_MIG) --sim-dri=$(SIM_DRI)"; \
	$(VM_IMAGE_ENV) $(BIN)/python -m conformance.lanes --jobs=$(LANE_JOBS) \
	  conformance workloads $$sim --junitxml=$(REPORTS)/conformance.xml \
	  --conformance-json=$(REPORTS)/conformance.json \
	  --conformance-html=$(REPORTS)/conformance.html \
	  --conformance-markdown=$(REPORTS)/conformance.md $(PYTEST_ARGS)

# The Go driver of examples/drivers/gosandbox (standard library only: no module proxy is
# asked), for tests/drivers/test_gosandbox.py and --driver=exec:examples/drivers/gosandbox/driver.yaml.
# Its jails' system call filter is the project's (drivers/seccomp.py), written for this
# machine's architecture as the BPF program that the build embeds (seccomp.bpf, not committed).
# Where Go is missing, nothing is built and its lane is skipped, saying what it needed.
GOSANDBOX := examples/drivers/gosandbox
.PHONY: gosandbox
gosandbox: venv
	@if command -v go >/dev/null; then \
	  $(BIN)/python -m drivers.seccomp $(GOSANDBOX)/seccomp.bpf && \
	  cd $(GOSANDBOX) && GOFLAGS=-mod=mod GOPROXY=off go build -o gosandbox .; \
	else \
	  echo "gosandbox: not built: needed go on PATH (Debian: apt-get install golang-go)" >&2; \
	fi

# OpenShell's own CLI, the binary of PyPI's openshell 0.0.111, and its generated gRPC code, for
# the OpenShell manifest and its stand-in gateway (openshell_standin/): cached in
# /var/cache/gpu-sandbox/openshell; where glibc is older than the binary's 2.39 (Debian 12),
# Debian 13's libc6 is unpacked beside it and scripts/openshell runs it through that loader.
.PHONY: openshell
openshell: $(BIN)/.installed
	@PYTHON=$(BIN)/python scripts/openshell.sh install

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(BIN)/check-jsonschema --builtin-schema vendor.dependabot .github/dependabot.yml
	$(BIN)/zizmor --offline .

# The engine self-tests need dockerd and podman: installed when missing, started when not
# running, and those this target started are stopped at the end.
# The engines and the cluster it starts, it stops again; those that were running stay.
test: venv host-packages test-packages lint vm-image gosandbox openshell
	@$(ENGINES) install
	@$(CLUSTER) install
	@cluster_was_up=""; $(CLUSTER) status >/dev/null 2>&1 && cluster_was_up=1; \
	$(CLUSTER) start || exit 1; \
	started="$$($(ENGINES) start)" || exit 1; rc=0; \
	$(VM_IMAGE_ENV) $(BIN)/pytest tests -n 2 -p no:cacheprovider $(PYTEST_ARGS) || rc=$$?; \
	[ -z "$$started" ] || $(ENGINES) stop $$started; \
	[ -n "$$cluster_was_up" ] || $(CLUSTER) stop; exit $$rc

# `make test` again and again (fresh clones, CI=true) beside CPU hogs and a conformance loop
# against the engines; reports pass counts and the tests that failed, by name.
test-stress: venv host-packages test-packages engines cluster
	$(BIN)/python -m bench.stress $(STRESS_ARGS)

bench: venv host-packages
	$(BIN)/python -m bench $(BENCH_ARGS)

bench-engines: venv engines
	$(BIN)/python -m bench.engines $(BENCH_ARGS)

# The vm driver's lifecycle against a bare QEMU boot, boot times, memory, the lane's time.
bench-vm: venv vm-image
	$(BIN)/python -m bench.vm $(BENCH_ARGS)

# The kubernetes lane: pod lifecycle against `kubectl run --rm -i`, the cluster's memory,
# the lane's wall time (bench/kubernetes.py).
.PHONY: bench-kubernetes
bench-kubernetes: venv cluster
	$(BIN)/python -m bench.kubernetes $(BENCH_ARGS)

# The cluster node by node: the kubernetes lane on one node against two side by side, a
# second node added for it (bench/nodes.py; BENCH_ARGS=--runs=3; --runner=job for the Jobs
# in the cluster, after make job-image).
.PHONY: bench-nodes
bench-nodes: venv cluster
	$(BIN)/python -m bench.nodes $(BENCH_ARGS)

# Matmul and copy payloads in a reference sandbox vs the bare host; CPU mode without a GPU.
bench-workloads: venv host-packages
	$(BIN)/python -m bench.workloads $(BENCH_ARGS)

# How fast `gpu-sandbox spec` starts, beside `python -c pass` (docs/cli.md: Try a driver by hand).
# The external adapter's per-operation overhead against the reference driver (bench/external.py).
.PHONY: bench-external
bench-external: venv host-packages
	$(BIN)/python -m bench.external $(BENCH_ARGS)

# How long a kill at an exec's timeout takes, driver by driver, beside a round trip of
# `true` and the room SANDBOX-EXEC-01's bound leaves (bench/kill.py).
.PHONY: bench-kill
bench-kill: venv host-packages gosandbox
	$(BIN)/python -m bench.kill $(BENCH_ARGS)

# What a payload printing 1 GB through exec costs the runner's memory, driver by driver
# (bench/exec_memory.py; BENCH_ARGS=--bytes=N).
.PHONY: bench-exec-memory
bench-exec-memory: venv host-packages
	$(BIN)/python -m bench.exec_memory $(BENCH_ARGS)

# Where each lane's wall time goes: CPU of the suite and of the engines, idle share, the
# slowest tests (bench/profile.py; BENCH_ARGS=--lanes=reference,vm --runs=1).
.PHONY: bench-profile
bench-profile: venv host-packages
	$(VM_IMAGE_ENV) $(BIN)/python -m bench.profile $(BENCH_ARGS)

# The five lanes in one pytest run against python -m conformance.lanes side by side, medians
# of rounds (bench/lanes.py; BENCH_ARGS=--runs=3 --jobs=2,3).
.PHONY: bench-lanes
bench-lanes: venv host-packages
	$(VM_IMAGE_ENV) $(BIN)/python -m bench.lanes $(BENCH_ARGS)

.PHONY: bench-cli
bench-cli: venv
	$(BIN)/python -m bench.cli $(BENCH_ARGS)

# Mutation testing (bench/mutate.py): a seeded sample of cosmic-ray's mutants of the reference
# driver and the host layer's grant, lease, liveness, validation and uid modules, each run
# against the whole catalogue on a simulated host, as root; the score, and the survivors'
# triage (bench/mutants.yaml). Within 40 minutes on 2 cores; never part of `make test`.
# MUTATE_ARGS: --seed=N --per-module=N --modules=a.py,b.py; --list shows the sample; --only=NAME
# (as listed, repeatable) runs those mutants alone.
.PHONY: mutate
MUTATE_ARGS ?=
mutate: venv host-packages
	$(BIN)/python -m bench.mutate $(MUTATE_ARGS)

# The property tests of bad input, long and unseeded (the nightly job): what `make test` runs
# in a short seeded pass. FUZZ_ARGS=-x stops at the first finding.
.PHONY: fuzz
FUZZ_ARGS ?=
fuzz: venv
	HYPOTHESIS_PROFILE=nightly $(BIN)/pytest tests -m fuzz -p no:cacheprovider $(FUZZ_ARGS)

clean:
	rm -rf $(VENV) $(REPORTS) *.egg-info
