"""deploy/k8s/train.yaml, checked by parsing: the Service, Job and ConfigMap fit together, and the
container's command is one `shardwise train` accepts (its own parser and config validation) with
the rendezvous on node 0's pod; the Dockerfile installs what pyproject pins."""

from __future__ import annotations

import argparse
import re
import tomllib

import pytest
import yaml
from helpers import REPO
from packaging.requirements import Requirement

from shardwise.cli import _add_train_parser, _train_config

MANIFEST = REPO / "deploy" / "k8s" / "train.yaml"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    documents = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    for doc in documents:
        assert {"apiVersion", "kind", "metadata", "spec" if doc["kind"] != "ConfigMap" else "data"} <= doc.keys()
    kinds = {doc["kind"]: doc for doc in documents}
    assert len(kinds) == len(documents), "one object of each kind"
    return kinds


def container(objects: dict) -> dict:
    (only,) = objects["Job"]["spec"]["template"]["spec"]["containers"]
    return only


def expand(arg: str, values: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a container's command."""
    return re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], arg)


def parsed_command(objects: dict, tmp_path, node_rank: str, pod_ip: str):
    command = container(objects)["command"]
    assert command[:2] == ["shardwise", "train"]
    args = [expand(arg, {"NODE_RANK": node_rank, "POD_IP": pod_ip}) for arg in command[2:]]
    config = tmp_path / "train.toml"
    config.write_text(objects["ConfigMap"]["data"]["train.toml"])
    mount = next(m for m in container(objects)["volumeMounts"] if m["name"] == "config")
    assert args[0] == f"{mount['mountPath']}/train.toml"
    parser = argparse.ArgumentParser(prog="shardwise")
    _add_train_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", str(config), *args[1:]])


def test_the_command_is_one_shardwise_train_accepts_on_every_node(objects, tmp_path):
    job = objects["Job"]["spec"]
    for rank in range(job["completions"]):
        args = parsed_command(objects, tmp_path, str(rank), f"10.0.0.{rank + 1}")
        cfg = _train_config(args)  # the whole config validated, as before any worker starts
        assert cfg.launch.nnodes == job["completions"] == job["parallelism"]
        assert cfg.launch.node_rank == rank and cfg.launch.node_addr == f"10.0.0.{rank + 1}"
        assert cfg.world_size == cfg.launch.nnodes * cfg.launch.nproc
        assert cfg.run.out.startswith(next(m["mountPath"] for m in container(objects)["volumeMounts"]
                                           if m["name"] == "runs"))


def test_the_rendezvous_is_node_0s_pod_through_the_headless_service(objects, tmp_path):
    service, job = objects["Service"], objects["Job"]
    pod = job["spec"]["template"]
    cfg = _train_config(parsed_command(objects, tmp_path, "1", "10.0.0.2"))
    host, port = cfg.launch.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # Indexed Job pod 0's DNS name
    assert job["spec"]["completionMode"] == "Indexed"
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert int(port) == service["spec"]["ports"][0]["port"] == container(objects)["ports"][0]["containerPort"]


def test_node_rank_and_address_come_from_the_downward_api(objects):
    env = {var["name"]: var["valueFrom"]["fieldRef"]["fieldPath"] for var in container(objects)["env"]}
    assert env == {"NODE_RANK": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
                   "POD_IP": "status.podIP"}
    used = set(re.findall(r"\$\((\w+)\)", " ".join(container(objects)["command"])))
    assert used == env.keys()


def test_volumes_are_the_ones_mounted_and_the_run_directory_is_shared(objects):
    pod = objects["Job"]["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert {mount["name"] for mount in container(objects)["volumeMounts"]} == volumes.keys()
    assert volumes["config"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    claim = volumes["runs"]["persistentVolumeClaim"]["claimName"]
    assert claim == objects["PersistentVolumeClaim"]["metadata"]["name"]
    assert objects["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # every rank writes


def test_the_dockerfile_installs_the_tested_torch_and_shardwise(objects):
    dockerfile = (REPO / "Dockerfile").read_text()
    supported = next(Requirement(dep) for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "dependencies"] if dep.startswith("torch"))
    tested = re.search(r"pip install -q torch==(\S+)", (REPO / "Makefile").read_text())[1]
    assert f"pip install torch=={tested}" in dockerfile and tested in supported.specifier
    assert "pip install ." in dockerfile and "COPY src ./src" in dockerfile
    assert container(objects)["image"].startswith("shardwise:")
