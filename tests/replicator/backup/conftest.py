"""Fixtures of the storage tests: emulators, fault proxy, and one Store per backend (see tests/kits/storage.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.backup.storage import Store, open_store  # noqa: E402
from replicator.backup.storage.memory import MemoryStore  # noqa: E402
from tests.kits.storage import (  # noqa: E402
    BACKENDS,
    BACKUP_BACKENDS,
    BUCKET,
    ENFORCES_CREATE_ONLY,
    TEST_GCS_OPTIONS,
    Emulator,
    FakeStorageControl,
    FaultProxy,
    HnsGcsStore,
)


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator("fake-gcs", tmp_path_factory.mktemp("fake-gcs"))
    yield emu
    emu.stop()


@pytest.fixture(scope="session")
def gcp_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator("gcp-emulator", tmp_path_factory.mktemp("gcp-emulator"))
    yield emu
    emu.stop()


# --------------------------------------------------------------------------- fault-injecting proxy


@pytest.fixture
def fault_proxy(fake_gcs: Emulator) -> Iterator[FaultProxy]:
    proxy = FaultProxy(fake_gcs.port)
    yield proxy
    proxy.close()


# --------------------------------------------------------------------------- one store per backend


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    if kind == "file":
        return open_store(str(tmp_path / "bucket"))
    if kind == "memory":
        request.addfinalizer(lambda: MemoryStore.wipe(prefix))
        return open_store(f"memory://{prefix}")
    if kind == "gcs-fake":
        return request.getfixturevalue("fake_gcs").store(prefix)
    if kind == "gcs-emulator":
        return request.getfixturevalue("gcp_emulator").store(prefix)
    if kind == "fsspec-memory":
        return open_store(f"fsspec+memory://{prefix}/root")
    raise ValueError(kind)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s = make_store(backend, request, tmp_path)
    yield s
    s.close()


@pytest.fixture
def create_only_enforced(backend: str) -> bool:
    return ENFORCES_CREATE_ONLY[backend]


# --------------------------------------------------------------------------- HNS stand-in and step helpers


def make_backup_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if kind == "memory-rename":
        name = f"t-{uuid.uuid4().hex[:10]}"
        request.addfinalizer(lambda: MemoryStore.wipe(name))
        return MemoryStore(name, rename=True)
    if kind == "gcs-hns-fake":
        emu = request.getfixturevalue("fake_gcs")
        client = emu.client()
        return HnsGcsStore(
            BUCKET,
            f"t-{uuid.uuid4().hex[:10]}",
            options=TEST_GCS_OPTIONS,
            client=client,
            control_client=FakeStorageControl(client, BUCKET),
        )
    return make_store(kind, request, tmp_path)


@pytest.fixture(params=BACKUP_BACKENDS)
def backup_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backup_target(backup_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s = make_backup_backend(backup_backend, request, tmp_path)
    yield s
    s.close()
