"""docs/rayservice.yaml, the KubeRay manifest: its Serve config is valid for Ray Serve and builds the tinygpt
deployment it describes (no cluster started); with ``KUBERAY_CRD`` naming KubeRay's RayService CRD file
(``ray-operator/config/crd/bases/ray.io_rayservices.yaml`` of a KubeRay checkout; no pip package ships it), the
manifest is also validated against the CRD's schema, unknown fields refused as ``kubectl --validate=strict`` does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs the cluster extra: pip install -e '.[cluster]'")
yaml = pytest.importorskip("yaml")

MANIFEST = Path(__file__).resolve().parents[1] / "docs" / "rayservice.yaml"


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))


def test_the_serve_config_builds_the_autoscaled_deployment():
    from ray.serve.schema import ServeDeploySchema

    from tinygpt.serving import replicas

    config = ServeDeploySchema(**yaml.safe_load(_manifest()["spec"]["serveConfigV2"]))
    (application,) = config.applications
    module, _, name = application.import_path.partition(":")
    assert module == replicas.__name__ and getattr(replicas, name) is replicas.build_app
    app = replicas.build_app(application.args)
    deployment = app._bound_deployment
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (1, 4)
    assert scaling.target_ongoing_requests == application.args["max_batch"] == 8
    assert deployment.ray_actor_options["num_cpus"] == 2
    assert app._bound_deployment.init_args[0] == "gpt2"
    with pytest.raises(ValueError, match="autoscale"):
        replicas.build_app({"model": "gpt2", "autoscale": "4:1"})
    with pytest.raises(ValueError, match="needs args.model"):
        replicas.build_app({})


def test_every_node_proxy_gets_the_lost_response_middleware():
    from tinygpt.serving.replicas import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    spec = _manifest()["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env[PROXY_CALLBACK_ENV] == PROXY_CALLBACK


def _strict(schema):
    """Unknown fields refused (Kubernetes would prune them silently), except where the CRD keeps them; int-or-string
    fields as either."""
    if isinstance(schema, dict):
        if schema.get("x-kubernetes-int-or-string"):
            schema.pop("type", None)
            schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in list(schema.values()):
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


@pytest.mark.skipif(not os.environ.get("KUBERAY_CRD"), reason="set KUBERAY_CRD to KubeRay's ray.io_rayservices.yaml")
def test_the_manifest_matches_kuberay_rayservice_schema():
    jsonschema = pytest.importorskip("jsonschema")
    crd = yaml.safe_load(Path(os.environ["KUBERAY_CRD"]).read_text(encoding="utf-8"))
    manifest = _manifest()
    version = next(v for v in crd["spec"]["versions"] if v["name"] == manifest["apiVersion"].split("/")[1])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in
              jsonschema.Draft7Validator(schema).iter_errors(manifest)]
    assert errors == []
    broken = {**manifest, "spec": {**manifest["spec"], "serveConfigV3": "typo"}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))  # the check does refuse an unknown field
