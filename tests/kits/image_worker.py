"""Test kit: the start of a simulated Pathways worker inside the sidecar image (``PathwaysSim(worker_setup=
"tests.kits.image_worker:setup")``, tests/deploy/test_image_work.py).

It imports colocated Python, as a colocated-Python server does before it unpickles its first program, and
writes what the worker then runs on to ``$MTC_IMAGE_REPORT_DIR/worker-<process>.json``: where the product's
packages come from, the jax it runs, and whether Orbax's colocated serialization patch and parsed absl flags are
in place with nothing of the test's doing (the image's own start hook, sidecar/pathways_start.py). Then, when the
job is Orbax's (``MTC_SIM_HOST_CWD`` set), the Orbax kit's setup: the host's own disk as working directory (its
Orbax patch stays off: ``MTC_SIM_ORBAX_PATCH=0``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

REPORT_ENV = "MTC_IMAGE_REPORT_DIR"


def _origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its parent package is missing
        return None
    return None if spec is None else spec.origin


def report() -> dict:
    import jax
    import jax.experimental.colocated_python  # noqa: F401 - what the colocated-Python server imports first

    parsed = patched = None
    if _origin("absl.flags") is not None:
        from absl import flags

        parsed = flags.FLAGS.is_parsed()
    if _origin("orbax.checkpoint") is not None:
        from orbax.checkpoint._src.multihost import colocated_transport

        patched = bool(colocated_transport._PATHWAYS_SERIALIZATION_PATCH_INSTALLED)
    return {"process": jax.process_index(), "uid": os.getuid(), "jax": jax.__version__, "jax_file": jax.__file__,
            **{name: _origin(name) for name in ("sidecar", "controller_client", "replicator", "orbax.checkpoint")},
            "orbax_patch_at_start": patched, "absl_flags_parsed_at_start": parsed}


def setup() -> None:
    got = report()
    out = Path(os.environ[REPORT_ENV])
    (out / f"worker-{got['process']}.json").write_text(json.dumps(got))
    if os.environ.get("MTC_SIM_HOST_CWD"):
        from tests.kits.orbax_colocated import worker_setup

        worker_setup()
