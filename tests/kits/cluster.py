"""Test kit: a cluster of real `mtc replicator` processes on 127.0.0.1 for multi-process scenarios."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller_client.demo.cluster import REPO
from controller_client.manager import CheckpointManager, CheckpointManagerOptions
from controller_client.topology import HostTopology
from replicator.coordinator.client import CoordinatorClient

__all__ = ["REPO"]  # re-exported for the tests; they drive the same LocalCluster as the demo


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


# --------------------------------------------------------------------------- controller-side helpers

def manager(cluster, slices: int, hosts_per_slice: int) -> CheckpointManager:
    devs = jax.devices()
    topo = HostTopology.simulated(devs, slices, hosts_per_slice)
    opts = CheckpointManagerOptions(local_directory=cluster.local_template, job_name="t",
                                    coordinator_address=cluster.coordinator, restore_wait_seconds=60,
                                    rpc_timeout_seconds=10)
    return CheckpointManager(opts, devices=devs, topology=topo)

def state(step: int, replicated_over_slices: bool = True) -> dict:
    """Params sharded over 'model' only are byte-identical on both slices (data-parallel replicas)."""
    devs = jax.devices()
    mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "model"))
    spec = P(None, "model") if replicated_over_slices else P("data", "model")
    rng = np.random.default_rng(step)
    return {
        "w": jax.device_put(rng.standard_normal((8, 64)).astype(np.float32), NamedSharding(mesh, spec)),
        "b": jax.device_put(jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16), NamedSharding(mesh, spec)),
        "rng": jax.device_put(jax.random.key(step), NamedSharding(mesh, P())),
        "step": step,
    }

def target(tree: dict) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        tree)

def assert_equal(a: dict, b: dict) -> None:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, jax.Array):
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y

def status(cluster, **detail):
    """The coordinator's typed status (``mtc_rpc.coordinator_pb2.GetStatusResponse``)."""
    c = CoordinatorClient(cluster.coordinator, rpc_timeout_seconds=5)
    try:
        return c.status(**detail)
    finally:
        c.close()

def step_summary(st, step: int):
    """The StepSummary of ``step`` in a typed status, or None."""
    return next((s for s in st.steps if s.step == step), None)

def redundant(cluster, step: int) -> bool:
    try:
        s = step_summary(status(cluster), step)
    except grpc.RpcError:
        return False
    return bool(s and s.complete and s.redundant)

def save_steps(mgr, steps, **kw) -> dict:
    trees = {}
    for s in steps:
        trees[s] = state(s, **kw)
        assert mgr.save(s, trees[s])
        mgr.wait_until_finished()
    return trees



def write_tls_files(d: Path) -> dict[str, str]:
    """A CA and one host certificate (127.0.0.1, localhost; usable as server and client) signed by it."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(cn: str, key, issuer: str, signer, ca: bool):  # type: ignore[no-untyped-def]
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, host_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {"ca": cert("mtc-ca", ca_key, "mtc-ca", ca_key, True),
             "cert": cert("mtc-host", host_key, "mtc-ca", ca_key, False)}
    out = {}
    for name, c in files.items():
        out[name] = str(d / f"{name}.pem")
        Path(out[name]).write_bytes(c.public_bytes(serialization.Encoding.PEM))
    out["key"] = str(d / "key.pem")
    Path(out["key"]).write_bytes(host_key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return out
