# Every target sets itself up on a fresh machine: a virtual environment in .venv with the
# CPU build of torch pinned (pip would otherwise pull a multi-GB CUDA build), then ftlm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ftlm-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup system-deps demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	# trl (the TRL parity tests) and otel (the OpenTelemetry tests) run in `make test` too; torch
	# is named again so that no dependency of theirs swaps the CPU build for another.
	$(PIP) install -e '.[test,native,otel,trl]' torch==2.13.0
	touch $(STAMP)

# The coordinator's hot path compiled to C with mypyc (ftlm.native; about 30 s on a quiet box), again
# whenever the build's manifest does not match its sources or this Python (`python -m ftlm.native
# status` says which runs and why). Without a C compiler or the Python headers the build says why
# and the interpreted modules run: the same code, slower. It stays in `setup`: at 2,000 groups the
# interpreted coordinator misses the quorum p99 target of 100 ms except on a quiet box (quiet, it
# measured 63-98 ms against compiled 53-67 ms; an hour later 94-149 against 84-98 ms; under a load
# of 13-19 on 2026-12-03 both missed by a factor of ten, interpreted 644-1470 ms, compiled 538-3128
# ms), and the compiled one is what meets it when the box allows (docs/ft-protocol.md, 'The
# compiled hot path'). `make test` runs the suite interpreted either way (below).
.PHONY: native
native: $(STAMP)
	@$(BIN)/python -m ftlm.native status >/dev/null || $(BIN)/python -m ftlm.native build --optional

setup: $(STAMP) native

demo: setup
	$(BIN)/ftlm demo

# Debian packages some tests run for real (Prometheus and promtool, headless Chromium; ip, tc and
# nft for the network test bed, tests/net); those tests skip with a reason when a binary is
# missing. CI runs as root, so it installs them.
SYSTEM_BINARIES := prometheus promtool chromium ip tc nft
SYSTEM_PACKAGES := prometheus chromium iproute2 nftables
system-deps:
	@missing=""; for b in $(SYSTEM_BINARIES); do command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "system-deps: missing$$missing; install the Debian packages '$(SYSTEM_PACKAGES)' as root" \
		     "(their tests will be skipped)"; exit 0; fi; \
	echo "system-deps: installing $(SYSTEM_PACKAGES) (missing:$$missing)"; \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES)

# Debian packages of the Slurm launcher tests: a one-node Slurm (slurmctld, slurmd, munge) that
# the tests start themselves, and shellcheck for the generated scripts. They skip, saying why,
# without them (or without root).
CLUSTER_BINARIES := slurmctld slurmd munged sbatch shellcheck
.PHONY: system-deps-cluster
system-deps-cluster:
	@missing=""; for b in $(CLUSTER_BINARIES); do command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || missing="$$missing $$b"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "system-deps-cluster: missing$$missing; install the Debian packages" \
		     "'slurm-wlm munge shellcheck' as root (their tests will be skipped)"; exit 0; fi; \
	echo "system-deps-cluster: installing slurm-wlm munge shellcheck (missing:$$missing)"; \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge shellcheck

# The default tier keeps one real-process test per fault path (the protocol simulation visits
# thousands of schedules of each); the slow tier (`make test-slow`) runs the longer real-process
# variants: every all-reduce kill point, a group killed while it receives state or near the end,
# the last holder preempted mid-transfer, a link failing every step, a SIGSTOPped group resumed,
# a catch-up that overflows its buffer, Slurm requeues, compiles, the FSDP2 example under chaos,
# every documented command run as written. Each slow test's docstring names what covers its path
# in the default tier.
.PHONY: test-slow
# Each suite runs once, on the interpreted modules (FTLM_NATIVE=0): every test, those that patch
# module functions a compiled caller would call directly included. The compiled build is checked
# against them by tests/test_native.py (the same simulated jobs, event for event), which runs where
# the build exists (`setup` makes it) and skips, saying why, elsewhere.
test: setup system-deps system-deps-cluster
	$(BIN)/lint-imports
	FTLM_NATIVE=0 $(BIN)/python -m pytest -q -m "not slow" --durations=25

test-slow: setup system-deps system-deps-cluster
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/python -m bench

# The model lifecycle on a CPU (pretrain -> SFT -> DPO / GRPO, 5 independent chains, then the
# earlier tables' DPO (RPO) from the same SFT models, then chain 0's SFT and GRPO again under
# chaos), merged into BENCHMARKS.md's table: about two hours on a quiet 2-core box (2.1 h
# of CPU in the run of 2026-12-04, one process at a time but for the 2-group chaos jobs). Models go to
# runs/lifecycle; a rerun takes back what is there (--reuse) and continues.
.PHONY: lifecycle
lifecycle: setup
	$(BIN)/python -m bench.lifecycle --table --json runs/lifecycle/table.json

# The test-time-scaling study from nothing: the policy (the lifecycle's SFT recipe, 1000 steps from
# scratch), a ~4x larger one, the verifiers, then the study (400 held-out add tasks, 3 seeds;
# BENCHMARKS.md 'Test-time scaling'). Models under runs/tts, reused by a rerun; about an hour
# of CPU on a quiet 2-core box (one process), hours at load.
.PHONY: tts
tts: setup
	$(BIN)/python -m bench.tts_pipeline

clean:
	rm -rf runs .pytest_cache src/ftlm/ft/_compiled
