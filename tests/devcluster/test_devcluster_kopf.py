"""kopf and the kubernetes library, configured as the project's operator is, work against the dev cluster."""

import threading
import time

import kopf
import kubernetes
import pytest
from kopf.testing import KopfRunner
from kvpolicy_dev.devcluster import ThreadedDevCluster

GROUP, VERSION, PLURAL = "kopf.example.dev", "v1", "gizmos"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": PLURAL, "singular": "gizmo", "kind": "Gizmo"},
        "versions": [{"name": VERSION, "served": True, "storage": True, "subresources": {"status": {}}}],
    },
}
FINALIZER = "kvpolicy.dev/finalizer"


@pytest.fixture
def gizmo_crd(devcluster: ThreadedDevCluster):
    devcluster.apply(CRD)
    yield
    devcluster.delete("apiextensions.k8s.io/v1", "CustomResourceDefinition", CRD["metadata"]["name"])


def operator(deleted: threading.Event) -> tuple[kopf.OperatorRegistry, kopf.OperatorSettings]:
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpolicy.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvpolicy.dev")
    settings.persistence.finalizer = FINALIZER
    settings.watching.server_timeout = 10
    # A registry of one's own lacks kopf's default login handlers; KUBECONFIG (set by the fixture) does the rest.
    kopf.on.login(registry=registry)(kopf.login_via_client)

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    def create_fn(body: kopf.Body, spec: kopf.Spec, patch: kopf.Patch, **_: object) -> None:
        kopf.info(body, reason="Created", message="create_fn handled the gizmo")  # posted as a core/v1 Event
        patch.status["phase"] = "Ready"
        patch.status["size"] = spec["size"] * 2

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=1)
    def heartbeat(name: str, namespace: str, stopped: kopf.DaemonStopped, **_: object) -> None:
        # Through the kubernetes library, configured from the same KUBECONFIG as kopf.
        kubernetes.config.load_kube_config()
        api = kubernetes.client.CustomObjectsApi()
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": {"daemon": "alive"}}
        )
        stopped.wait(60)

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def delete_fn(**_: object) -> None:
        deleted.set()

    return registry, settings


def kopf_posted_event(cluster: ThreadedDevCluster, namespace: str, text: str) -> bool:
    """kopf posts events from a background queue: poll for one that mentions `text`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(text in event["message"] for event in cluster.list("v1", "Event", namespace)):
            return True
        time.sleep(0.05)
    return False


def test_kopf_operator_handles_create_daemon_and_delete(
    devcluster: ThreadedDevCluster, devcluster_namespace: str, gizmo_crd: None
) -> None:
    deleted = threading.Event()
    registry, settings = operator(deleted)
    args = ["run", "--standalone", "--namespace", devcluster_namespace]
    with KopfRunner(args, registry=registry, settings=settings, timeout=60) as runner:
        kubernetes.config.load_kube_config()
        kubernetes.client.CustomObjectsApi().create_namespaced_custom_object(
            GROUP, VERSION, devcluster_namespace, PLURAL,
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Gizmo", "metadata": {"name": "g"}, "spec": {"size": 21}},
        )  # fmt: skip
        gizmo = devcluster.wait_for(
            f"{GROUP}/{VERSION}", "Gizmo", "g", devcluster_namespace,
            lambda obj: obj.get("status", {}).get("daemon") == "alive" and "phase" in obj.get("status", {}),
            give_up_after=30,
        )  # fmt: skip
        assert gizmo["status"]["phase"] == "Ready" and gizmo["status"]["size"] == 42
        assert gizmo["metadata"]["finalizers"] == [FINALIZER]
        annotations = gizmo["metadata"]["annotations"]
        assert "kvpolicy.dev/last-handled-configuration" in annotations
        assert kopf_posted_event(devcluster, devcluster_namespace, "create_fn")
        devcluster.delete(f"{GROUP}/{VERSION}", "Gizmo", "g", devcluster_namespace)
        devcluster.wait_deleted(f"{GROUP}/{VERSION}", "Gizmo", "g", devcluster_namespace, give_up_after=30)
        assert deleted.is_set()
    assert runner.exception is None and runner.exit_code == 0
