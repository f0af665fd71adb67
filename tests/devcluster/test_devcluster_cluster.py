"""DevCluster on the current loop, ThreadedDevCluster start-up failures, and the threaded cluster under looptime."""

import asyncio

import pytest
import yaml
from kvpolicy_dev.devcluster import DevCluster, NodePool, NoProcessRunner, ThreadedDevCluster


async def test_dev_cluster_on_the_current_loop(tmp_path) -> None:
    pools = [NodePool("h100", "NVIDIA-H100-80GB-HBM3", nodes=2, capacity_pods=1)]
    async with DevCluster(pools=pools, runner=NoProcessRunner(), namespaces=("serving",), workdir=tmp_path / "c") as c:
        config = yaml.safe_load(c.kubeconfig.read_text())
        assert config["clusters"][0]["cluster"]["server"] == c.url and c.kubeconfig.parent == tmp_path / "c"
        assert [node["metadata"]["name"] for node in c.list("v1", "Node")] == ["h100-0", "h100-1"]
        assert c.get("v1", "Node", "h100-1")["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert [ns["metadata"]["name"] for ns in c.list("v1", "Namespace")] == ["serving"]
        c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "serving"}})
        with pytest.raises(TimeoutError, match=r"ConfigMap serving/x: condition not met in 0.1s; last: \{"):
            await c.wait_for("v1", "ConfigMap", "x", "serving", lambda obj: "data" in obj, give_up_after=0.1)


def test_a_cluster_that_cannot_start_says_why() -> None:
    cluster = ThreadedDevCluster(pools=[NodePool("t4", "NVIDIA-T4")])
    with pytest.raises(RuntimeError, match="failed to start") as exc:
        cluster.start()
    assert "unknown GPU product 'NVIDIA-T4'" in str(exc.value.__cause__)
    cluster.stop()


@pytest.mark.looptime
async def test_threaded_cluster_keeps_real_time_under_looptime(
    devcluster: ThreadedDevCluster, devcluster_namespace: str
) -> None:
    ns = devcluster_namespace
    devcluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": ns},
                       "spec": {"containers": [{"name": "main", "image": "x"}]}})  # fmt: skip
    await asyncio.sleep(600)  # fake time: instant for the test, nothing for the cluster
    pod = await devcluster.await_for("v1", "Pod", "p", ns, lambda p: p.get("status", {}).get("phase") == "Running")
    assert pod["spec"]["nodeName"] == "cpu-0"


async def test_purging_a_namespace_removes_what_finalizers_hold() -> None:
    async with DevCluster(pools=[], runner=NoProcessRunner(), namespaces=("a", "b")) as c:
        for namespace in ("a", "b"):
            meta = {"name": "held", "namespace": namespace, "finalizers": ["example.dev/stuck"]}
            c.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta})
        c.delete("v1", "Namespace", "a")
        assert c.get("v1", "ConfigMap", "held", "a")["metadata"]["deletionTimestamp"]  # held, as on a real cluster
        c.purge_namespace("a")
        c.purge_namespace("a")  # nothing left to do: no error
        assert c.find("v1", "ConfigMap", "held", "a") is None
        assert c.find("v1", "ConfigMap", "held", "b") is not None
