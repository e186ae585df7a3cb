"""What the scenario tests share about one rendered JobSet: deploying it into its own namespace, and a watch of
its Pods that records when each one's deletion was first seen and when its object went."""

from __future__ import annotations

import threading
import time
from typing import Any

from kubernetes import watch

from controller_client import manifests as mf
from tests.cluster.test_apply import apply

TOKEN = "0123456789abcdef"


def deploy(api: Any, core: Any, opts: mf.ManifestOptions, ns: str) -> None:
    """Namespace ``ns``, the job's token Secret and every object ``mtc manifests`` renders for ``opts``."""
    core.create_namespace({"metadata": {"name": ns}})
    apply(api, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mtc-token"},
                "stringData": {"token": TOKEN}}, ns)
    for doc in mf.objects(opts).values():
        apply(api, doc, ns)


class PodWatch:
    """A thread watching namespace ``ns``'s Pods: ``deleted_at`` (Pod name -> monotonic time its deletion was
    first seen: a deletionTimestamp, or its removal) and ``removed_at`` ("name/uid" -> when its object was
    seen removed)."""

    def __init__(self, core: Any, ns: str) -> None:
        self.core, self.ns = core, ns
        self.deleted_at: dict[str, float] = {}
        self.removed_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for ev in w.stream(self.core.list_namespaced_pod, self.ns, timeout_seconds=5):
                    p = ev["object"]
                    now = time.monotonic()
                    if ev["type"] == "DELETED":
                        self.removed_at.setdefault(f"{p.metadata.name}/{p.metadata.uid}", now)
                    if ev["type"] == "DELETED" or p.metadata.deletion_timestamp is not None:
                        self.deleted_at.setdefault(p.metadata.name, now)
                    if self._stop.is_set():
                        break
            except Exception:  # noqa: BLE001 (the namespace going away, a slow answer: watch again)
                self._stop.wait(0.2)
            finally:
                w.stop()
