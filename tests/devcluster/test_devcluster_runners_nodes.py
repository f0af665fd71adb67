"""Pure parts of the kubelet stand-in: container runners, node pools, scheduling, pod IPs, Service URLs."""

import ipaddress
import random
import sys

import pytest
from kvpolicy_dev.devcluster import GPU_MODELS, POOL_LABEL, NodePool, SimulatorRunner
from kvpolicy_dev.devcluster.kubelet import job_argv, template_hash, with_condition
from kvpolicy_dev.devcluster.nodes import PodIpAllocator, rewrite_service_urls, schedule, unresolved_service_urls
from kvpolicy_dev.devcluster.runners import vllm_serve_args

H200_LABELS = NodePool("h200", "NVIDIA-H200").labels()


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        ({"command": ["vllm", "serve", "m"], "args": ["--kv-cache-dtype", "fp8"]}, ["m", "--kv-cache-dtype", "fp8"]),
        ({"args": ["serve", "m", "--max-model-len", "8192"]}, ["m", "--max-model-len", "8192"]),
        ({"command": ["vllm"], "args": ["serve", "m"]}, ["m"]),
        ({"command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}, None),
        ({"image": "nginx"}, None),
    ],
)
def test_vllm_containers_are_recognised(container: dict, expected: list[str] | None) -> None:
    assert vllm_serve_args(container) == expected


def test_simulator_runner_argv() -> None:
    runner = SimulatorRunner(time_scale=0.001, two_level_fix_images=frozenset({"vllm:fixed"}), seed=7)
    container = {"image": "vllm:fixed", "command": ["vllm", "serve"], "args": ["m", "--kv-cache-dtype", "fp8"],
                 "ports": [{"containerPort": 9000}]}  # fmt: skip
    assert runner.argv(container, H200_LABELS, "127.9.0.1") == [
        sys.executable, "-m", "kvpolicy", "sim", "m", "--kv-cache-dtype", "fp8",
        "--host", "127.9.0.1", "--port", "9000", "--gpu", "h200", "--two-level-fix",
        "--time-scale", "0.001", "--seed", "7",
    ]  # fmt: skip
    fast = SimulatorRunner(fast_head_dim_256_images=frozenset({"vllm:new"}))
    argv = fast.argv({"image": "vllm:new", "args": ["serve", "m"]}, NodePool("b", "NVIDIA-B200").labels(), "127.9.0.2")
    assert argv is not None
    assert argv[argv.index("--port") + 1] == "8000" and argv[argv.index("--gpu") + 1] == "b200"
    assert "--fast-head-dim-256" in argv and "--two-level-fix" not in argv
    assert runner.argv({"image": "nginx"}, H200_LABELS, "127.9.0.3") is None
    with pytest.raises(ValueError, match=r"nvidia\.com/gpu\.product"):
        runner.argv({"args": ["serve", "m"]}, NodePool("cpu", None).labels(), "127.9.0.4")


def test_node_pools_carry_gpu_feature_discovery_labels() -> None:
    assert H200_LABELS["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert H200_LABELS["nvidia.com/gpu.family"] == "hopper"
    assert (H200_LABELS["nvidia.com/gpu.compute.major"], H200_LABELS["nvidia.com/gpu.compute.minor"]) == ("9", "0")
    assert H200_LABELS["nvidia.com/gpu.present"] == "true" and H200_LABELS[POOL_LABEL] == "h200"
    assert NodePool("l40s", "NVIDIA-L40S").labels()["nvidia.com/gpu.compute.minor"] == "9"
    assert {model.simulator_name for model in GPU_MODELS.values()} == {"h100", "h200", "b200", "a100", "l40s"}
    with pytest.raises(ValueError, match="unknown GPU product 'NVIDIA-T4'"):
        NodePool("t4", "NVIDIA-T4").labels()


def test_pod_ips_are_distinct_loopback_addresses() -> None:
    allocator = PodIpAllocator(random.Random(1))
    ips = [allocator.allocate() for _ in range(600)]
    assert len(set(ips)) == 600
    assert all(ipaddress.ip_address(ip).is_loopback and not ip.startswith("127.0.") for ip in ips)
    assert all(not ip.endswith((".0", ".255")) for ip in ips)


NODES = [node for pool in (NodePool("h100", "NVIDIA-H100-80GB-HBM3", capacity_pods=1), NodePool("cpu", None))
         for node in pool.node_objects()]  # fmt: skip
POOLS = {"h100": NodePool("h100", "NVIDIA-H100-80GB-HBM3", capacity_pods=1), "cpu": NodePool("cpu", None)}


def test_scheduling_honours_selectors_and_pool_capacity() -> None:
    on_h100 = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert schedule(on_h100, NODES, POOLS, {}) == ("h100-0", "")
    assert schedule(on_h100, NODES, POOLS, {"h100": 1}) == (
        None,
        "0/2 nodes are available: insufficient nvidia.com/gpu",
    )
    on_b200 = {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-B200"}}
    assert schedule(on_b200, NODES, POOLS, {}) == (
        None,
        "0/2 nodes are available: 2 node(s) didn't match Pod's node selector",
    )
    gpu_request = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": 1}}}]}
    assert schedule(gpu_request, NODES, POOLS, {"h100": 1})[0] is None
    assert schedule({"containers": [{}]}, NODES, POOLS, {"h100": 1}) == ("cpu-0", "")  # CPU pods use no GPU capacity


def ready_pod(name: str, namespace: str, ip: str, **labels: str) -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def service(name: str, namespace: str, port: int, target: int | str, **selector: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector, "ports": [{"port": port, "targetPort": target}]}}  # fmt: skip


def test_service_urls_resolve_to_a_ready_pod() -> None:
    services = [service("vllm", "a", 80, "http", app="vllm"), service("gate", "b", 9000, 8080, app="gate")]
    not_ready = {**ready_pod("p0", "a", "127.1.1.9", app="vllm"), "status": {"podIP": "127.1.1.9"}}
    pods = [not_ready, ready_pod("p1", "a", "127.1.1.1", app="vllm"), ready_pod("p2", "b", "127.1.1.2", app="gate")]
    text = ("--url http://vllm.a.svc.cluster.local/v1 http://vllm/v1 http://gate.b.svc:9000 http://vllm:81 "
            "http://other:80 http://gate:9000 http://vllm.a.svc.example.com")  # fmt: skip
    assert rewrite_service_urls(text, "a", services, pods) == (
        "--url http://127.1.1.1:8000/v1 http://127.1.1.1:8000/v1 http://127.1.1.2:8080 http://vllm:81 "
        "http://other:80 http://gate:9000 http://vllm.a.svc.example.com"
    )


def test_unresolved_service_urls() -> None:
    services = [service("vllm", "a", 80, 8000, app="vllm"), service("idle", "a", 80, 8000, app="idle")]
    pods = [ready_pod("p1", "a", "127.1.1.1", app="vllm")]
    text = ("http://vllm.a.svc:80 http://late.a.svc.cluster.local:8080/x http://idle:80 http://idle.a.svc "
            "http://localhost:8000 http://vllm")  # fmt: skip
    assert unresolved_service_urls(text, "a", services, pods) == [
        "http://late.a.svc.cluster.local:8080", "http://idle:80", "http://idle.a.svc"]  # fmt: skip


def test_job_commands() -> None:
    assert job_argv({"command": ["kvpolicy", "gate"], "args": ["accuracy"]}) == [
        sys.executable, "-m", "kvpolicy", "gate", "accuracy"]  # fmt: skip
    assert job_argv({"command": ["python3", "-c", "pass"]}) == [sys.executable, "-c", "pass"]
    assert job_argv({"command": ["/bin/true"]}) == ["/bin/true"]
    with pytest.raises(ValueError, match="no command"):
        job_argv({"image": "busybox"})


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    first = with_condition([], "Ready", "False", "Starting")
    again = with_condition(first, "Ready", "False", "StillStarting")
    assert again[0]["lastTransitionTime"] == first[0]["lastTransitionTime"] and again[0]["reason"] == "StillStarting"
    assert template_hash({"a": 1, "b": 2}) == template_hash({"b": 2, "a": 1}) != template_hash({"a": 2})
