"""Session fixtures of the image tests (``-m image``): one private buildah/podman store, one base, each image
built once (tests/kits/images.py). Nothing here runs unless an image test asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kits.images import Store, check_tools, pinned
from tests.kits.jax_procs import REPO


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """The store, holding the python:3.11-slim stand-in made by debootstrap."""
    check_tools()
    s = Store(tmp_path_factory.mktemp("images"))
    try:
        s.make_base()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def colocated_base(store: Store) -> str:
    """The stand-in for Google's colocated-Python image (jax, jaxlib, cloudpickle; no orbax-checkpoint)."""
    return store.make_colocated_base(pinned("jax"), pinned("cloudpickle"))


@pytest.fixture(scope="session")
def sidecar_image(store: Store, colocated_base: str) -> str:
    """Dockerfile.sidecar, unchanged, on the colocated-Python stand-in (base mode)."""
    store.build(REPO / "Dockerfile.sidecar", "localhost/mtc-sidecar:test", REPO, f"PYTHON_IMAGE={store.base}",
                f"BASE_IMAGE={colocated_base}")
    return "localhost/mtc-sidecar:test"


@pytest.fixture(scope="session")
def replicator_image(store: Store) -> str:
    """Dockerfile.replicator, unchanged, on the python:3.11-slim stand-in."""
    store.build(REPO / "Dockerfile.replicator", "localhost/mtc-replicator:test", REPO, f"PYTHON_IMAGE={store.base}")
    return "localhost/mtc-replicator:test"
