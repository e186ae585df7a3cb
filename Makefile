# Quick start: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: demo test lint proto bench clean constraints smoke-newest image-test test-faults

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
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -rfER -n 2 -m "not image and not faults" tests

# Network faults against real replicators, each host in a network namespace of the test's own joined by a
# bridge in another (tests/faults; root, ip, iptables, tc; ~15 min): partitions, lossy/slow links, disk, memory
# and bucket faults, healed, then
# checked by a history checker that prints one JSON line (docs/testing.md, "Network faults"). No reruns:
# a flaky fault test is a finding. The memory cases (tests/faults/test_memory.py) also make a memory cgroup
# (v1 or v2) and a tmpfs of their own, removed at teardown; skipped when there is no memory controller.
# RAM-disk faults: a FUSE filesystem (Debian fuse3, PyPI mfusepy) and small tmpfs mounts of the test's own.
test-faults: $(STAMP)
	command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      iproute2 iptables >/dev/null; }
	command -v fusermount3 >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
	  -y -qq --no-install-recommends fuse3 >/dev/null; }
	$(PY) -m pytest -q -rfER -p no:cacheprovider -m faults tests/faults

# Real builds of Dockerfile.replicator and Dockerfile.sidecar with Debian's buildah (vfs, chroot isolation)
# on a base made by debootstrap, and the built images doing real work under Debian's podman with runc
# (tests/deploy/test_image_build.py, test_image_work.py; ~6 min on 2 cores; needs root, Debian's archive, PyPI).
IMAGE_TOOLS := buildah podman runc debootstrap
image-test: $(STAMP)
	$(foreach t,$(IMAGE_TOOLS),command -v $(t) >/dev/null &&) true || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      $(IMAGE_TOOLS) >/dev/null; }
	$(PY) -m pytest -q -rfER -m image tests/deploy/test_image_build.py tests/deploy/test_image_work.py

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
