"""sidecar/pathways_start.py, the sidecar image's start hook (Dockerfile.sidecar's .pth line), in fresh
interpreters: it loads nothing at start and prepares the worker once colocated Python is imported.
(tests/deploy/test_image_work.py shows it working in the built image.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.kits.jax_procs import REPO

PTH_LINE = "import sidecar.pathways_start as s; s.arm()"  # what Dockerfile.sidecar writes


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", f"{PTH_LINE}\n{code}"], capture_output=True, text=True, timeout=120,
                          cwd=str(REPO), env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_armed_at_start_it_loads_nothing_until_colocated_python_is_imported() -> None:
    got = _run("import sys, json, jax\n"
               "print(json.dumps({'orbax': 'orbax.checkpoint' in sys.modules, 'absl': 'absl.flags' in sys.modules}))")
    assert got == {"orbax": False, "absl": False}


def test_importing_colocated_python_installs_orbax_patch_and_parses_flags() -> None:
    got = _run("import json\n"
               "from jax.experimental.colocated_python import serialization\n"
               "from orbax.checkpoint._src.multihost import colocated_transport as t\n"
               "from absl import flags\n"
               "print(json.dumps({'patched': t._PATHWAYS_SERIALIZATION_PATCH_INSTALLED,"
               " 'map': serialization._get_cpu_device_map is t._get_cpu_device_map,"
               " 'parsed': flags.FLAGS.is_parsed()}))")
    assert got == {"patched": True, "map": True, "parsed": True}


def test_flags_someone_parsed_stay_as_parsed() -> None:
    got = _run("import json\n"
               "from absl import flags\n"
               "flags.DEFINE_integer('mtc_probe', 1, '')\n"
               "flags.FLAGS(['prog', '--mtc_probe=7'])\n"
               "import jax.experimental.colocated_python\n"
               "print(json.dumps({'probe': flags.FLAGS.mtc_probe}))")
    assert got == {"probe": 7}
