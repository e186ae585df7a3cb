# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint proto bench clean constraints smoke-newest image-test test-faults cluster-bin test-cluster

# Everything the demo and the suite need, at the exact versions of constraints.txt.
EXTRAS := jax,elastic,dev

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mtc demo

test: $(STAMP)
	command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
	  -y -qq --no-install-recommends prometheus >/dev/null; }
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rfER -n 2 -m "not image and not faults and not cluster" tests

# Network faults against real replicators, each host in a network namespace of the test's own joined by a
# bridge in another (tests/faults; root, ip, iptables, tc; ~15 min): partitions, lossy/slow links, disk, memory
# and bucket faults, healed, then
# checked by a history checker that prints one JSON line (docs/testing.md, "Network faults"). No reruns:
# a flaky fault test is a finding. The memory cases (tests/faults/test_memory.py) also make a memory cgroup
# (v1 or v2) and a tmpfs of their own, removed at teardown. RAM-disk faults: a FUSE filesystem (Debian fuse3,
# PyPI mfusepy) and small tmpfs mounts of the test's own. Without root, the tools, FUSE or a memory controller
# the tests skip, and say so; under CI=true the run fails naming what is missing (tests/faults/conftest.py).
test-faults: $(STAMP)
	command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      iproute2 iptables >/dev/null; }
	command -v fusermount3 >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
	  -y -qq --no-install-recommends fuse3 >/dev/null; }
	$(PY) -m pytest -q -rfEsR -p no:cacheprovider -m faults tests/faults

# Real builds of Dockerfile.replicator and Dockerfile.sidecar with Debian's buildah (vfs, chroot isolation)
# on a base made by debootstrap, and the built images doing real work under Debian's podman with runc
# (tests/deploy/test_image_build.py, test_image_work.py; ~6 min on 2 cores; needs root, Debian's archive, PyPI).
IMAGE_TOOLS := buildah podman runc debootstrap
image-test: $(STAMP)
	$(foreach t,$(IMAGE_TOOLS),command -v $(t) >/dev/null &&) true || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      $(IMAGE_TOOLS) >/dev/null; }
	$(PY) -m pytest -q -rfER -m image tests/deploy/test_image_build.py tests/deploy/test_image_work.py

# A real Kubernetes control plane from Go modules (versions pinned by the go.mod/go.sum files under
# tests/cluster/): etcd, kube-apiserver, kube-controller-manager, kube-scheduler (Kubernetes v1.36.3) and JobSet's
# controller (v0.12.0) and its in-place-restart agent, built into build/cluster/bin (ignored; a warm rebuild only checks the cache).
CLUSTER_BIN := $(CURDIR)/build/cluster/bin
cluster-bin:
	cd tests/cluster/controlplane && go build -o $(CLUSTER_BIN)/ ./cmd/etcd k8s.io/kubernetes/cmd/kube-apiserver \
	  k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler
	cd tests/cluster/jobset && go build -o $(CLUSTER_BIN)/jobset sigs.k8s.io/jobset && \
	  go build -o $(CLUSTER_BIN)/in-place-restart-agent sigs.k8s.io/jobset/cmd/in-place-restart-agent

# The rendered JobSets on that control plane, their Pods run by a node agent of the tests' own (Pods in network
# and mount namespaces of their own; root, ip, iptables), every notice, loss and hot-swap checked for the real
# controllers' decisions and for the data; ends with one JSON line (docs/testing.md, "The real control plane").
test-cluster: $(STAMP) cluster-bin
	command -v ip >/dev/null && command -v iptables >/dev/null && command -v unshare >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      iproute2 iptables util-linux >/dev/null; }
	$(PY) -m pytest -q -rfER -p no:cacheprovider -m cluster tests/cluster

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Regenerate gRPC stubs from proto/ (tests check that this yields no diff).
proto: $(STAMP)
	$(PY) -m mtc_rpc.regen

bench: $(STAMP)
	$(PY) -m bench.local

# Re-pin constraints.txt from a fresh environment after changing dependencies in pyproject.toml.
constraints:
	rm -rf .venv-pin && $(PYTHON) -m venv .venv-pin
	.venv-pin/bin/pip install --quiet -e '.[$(EXTRAS)]'
	{ sed -n '1,3p' constraints.txt; .venv-pin/bin/pip freeze --exclude-editable | sort -f; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf .venv-pin

# The newest releases the [jax] and [elastic] ranges allow (no constraints.txt), in a venv of their own:
# the demo, the elastic demo with Orbax's Snapshotter, and the Orbax drop-in against our replicator.
# `make test` stays on the pinned versions; CI runs both. See docs/testing.md, "JAX versions".
NEWEST := .venv-newest
smoke-newest:
	rm -rf $(NEWEST) && $(PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST)/bin/python -m pip install --quiet '.[$(EXTRAS)]'
	$(NEWEST)/bin/python -c "import jax, orbax.checkpoint as o, pathwaysutils as p; \
	  print('newest: jax', jax.__version__, 'orbax-checkpoint', o.__version__, 'pathwaysutils', p.__version__)"
	$(NEWEST)/bin/mtc demo
	$(NEWEST)/bin/mtc demo --elastic --snapshotter
	$(NEWEST)/bin/python -m pytest -q -p no:cacheprovider \
	  tests/replicator/orbax/test_orbax_multiprocess.py::test_save_then_restart_restores_bit_exact \
	  tests/replicator/orbax/test_mode.py::test_two_slices_restart_wipe_one_wipe_all_backup_every_n_steps

clean:
	rm -rf $(VENV) $(NEWEST) build *.egg-info .pytest_cache
