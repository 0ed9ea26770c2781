"""Lint of deploy/: the Helm chart and the Dynamo graph.

Neither can run here (there is no Kubernetes on the development machines), so these
tests check what can go wrong without a cluster: the YAML parses; the chart, rendered
from its values.yaml, gives objects with the fields Kubernetes requires, selectors that
match their pods, probes and Services on ports that exist; every `python -m X` names a
module of this repository and gives only flags its argparse knows; the tritonserver
command is the one launcher/stack.py runs; the chart and the graph run the same
commands in the image the Dockerfile builds. helm and kubeconform, where installed,
check the chart the way a cluster would.
"""

from __future__ import annotations

import copy
import importlib.machinery
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.layout import REPO_ROOT, TritonInstall
from launcher.stack import TritonPorts, TritonServer

DEPLOY = REPO_ROOT / "deploy"
CHART = DEPLOY / "helm" / "tritonllm"
GRAPH = DEPLOY / "dynamo" / "graph.yaml"
RELEASE = "tritonllm"
IMAGE_ROOT = "/opt/tritonllm"  # the Dockerfile's WORKDIR: the repository in the image
# Every option of values.yaml turned on, so the `{{- if }}` blocks are rendered too.
OPTIONS_ON = {"model": {"pvcClaimName": "models"}, "apiKeys": {"secretName": "tritonllm-keys"}}
# The service fields of Dynamo's own DynamoGraphDeployment examples; others are unchecked.
GRAPH_SERVICE_FIELDS = {"componentType", "dynamoNamespace", "replicas", "resources", "extraPodSpec"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

_EXPR = re.compile(r"{{-?\s*(\.[\w.]+)\s*-?}}")
_IF = re.compile(r"^\s*{{-?\s*if\s+(\.[\w.]+)\s*-?}}\s*$")
_END = re.compile(r"^\s*{{-?\s*end\s*-?}}\s*$")


# -- a renderer of the little Helm the templates use ------------------------------------


def render(text: str, values: dict, release: str = RELEASE) -> str:
    """The template with `{{ .A.b }}` substituted and `{{- if .A.b }}` lines kept or
    dropped, as helm would; anything else in `{{ }}` fails, so templates stay this simple."""
    scope = {"Values": values, "Release": {"Name": release}, "Chart": {"Name": chart_meta()["name"]}}
    shown: list[bool] = []  # one per open `if`
    lines = []
    for line in text.splitlines():
        if match := _IF.match(line):
            shown.append(bool(lookup(scope, match[1])))
        elif _END.match(line):
            assert shown, "an `end` without its `if`"
            shown.pop()
        elif all(shown):
            lines.append(_EXPR.sub(lambda m: _as_text(lookup(scope, m[1])), line))
    assert not shown, "an `if` without its `end`"
    out = "\n".join(lines)
    assert "{{" not in out, f"a template expression the test's renderer does not know: {out[out.index('{{') :][:80]}"
    return out


def lookup(scope: dict, path: str):
    value = scope
    for key in path.strip(".").split("."):
        assert isinstance(value, dict) and key in value, f"{path} is not in values.yaml"
        value = value[key]
    return value


def _as_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def merged(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def chart_meta() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def render_chart(options: dict | None = None) -> list[dict]:
    vals = merged(values(), options or {})
    docs = []
    for template in sorted((CHART / "templates").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(render(template.read_text(), vals)) if d]
    return docs


@pytest.fixture(scope="module", params=[{}, OPTIONS_ON], ids=["defaults", "options-on"])
def objects(request) -> list[dict]:
    return render_chart(request.param)


# -- what the manifests run -----------------------------------------------------------


def chart_pods(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"}


def graph() -> dict:
    return yaml.safe_load(GRAPH.read_text())


def graph_containers() -> dict[str, dict]:
    """Each graph service's containers by name: the main one (named after its service) and the sidecars."""
    out = {}
    for name, service in graph()["spec"]["services"].items():
        pod = service["extraPodSpec"]
        out[name] = pod["mainContainer"]
        out.update((c["name"], c) for c in pod.get("containers", []))
    return out


def all_containers() -> list[dict]:
    pods = chart_pods(render_chart(OPTIONS_ON)).values()
    return [c for pod in pods for c in pod["containers"]] + list(graph_containers().values())


def argv(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def module_source(name: str) -> Path | None:
    """The file `python -m NAME` runs from the repository, found as the import system finds
    it but without importing (the frontend's imports are heavy)."""
    path, spec = [str(REPO_ROOT)], None
    for part in name.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec.submodule_search_locations:
        main = Path(path[0]) / "__main__.py"
        return main if main.exists() else None
    return Path(spec.origin)


def python_modules() -> list[tuple[str, list[str]]]:
    """(module, its arguments) of every `python -m` in the chart and the graph."""
    out = []
    for command in map(argv, all_containers()):
        if command[:2] == ["python", "-m"]:
            out.append((command[2], command[3:]))
    return out


# -- the tests ------------------------------------------------------------------------


def test_every_yaml_file_parses():
    files = [p for p in DEPLOY.rglob("*.yaml") if "templates" not in p.parts]
    assert {p.name for p in files} >= {"Chart.yaml", "values.yaml", "graph.yaml"}
    for path in files:
        assert [d for d in yaml.safe_load_all(path.read_text()) if d], f"{path} holds no document"


def test_objects_have_the_fields_kubernetes_requires(objects):
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        assert DNS_NAME.match(obj["metadata"]["name"]), obj["metadata"]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    parts = ("worker", "frontend", "nats", "etcd")
    assert [k for k in kinds if k[0] == "Deployment"] == sorted(("Deployment", f"{RELEASE}-{p}") for p in parts)


def test_deployment_selectors_match_their_pods(objects):
    for obj in (o for o in objects if o["kind"] == "Deployment"):
        selector = obj["spec"]["selector"]["matchLabels"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), obj["metadata"]["name"]
        assert isinstance(obj["spec"]["replicas"], int)


def _ports(container: dict) -> set:
    """A container's ports by name and by number: a probe or a Service may use either."""
    ports = container.get("ports", [])
    return {p.get("name") for p in ports} | {p["containerPort"] for p in ports}


def test_probes_use_ports_their_container_has(objects):
    containers = [c for pod in chart_pods(objects).values() for c in pod["containers"]]
    for container in containers + list(graph_containers().values()):
        for probe in filter(None, map(container.get, PROBES)):
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert action["port"] in _ports(container), (container["name"], probe)


def test_services_reach_a_deployments_port(objects):
    pods = [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        matches = [p for p in pods if selector <= p["metadata"]["labels"].items()]
        assert len(matches) == 1, service["metadata"]["name"]
        ports = set().union(*map(_ports, matches[0]["spec"]["containers"]))
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)


def test_variable_references_are_defined_before_use():
    """Kubernetes expands `$(NAME)` in command, args and env only for variables the
    container defines (above, for env); anything else stays literal text."""
    for container in all_containers():
        defined = set()
        for env in container.get("env", []):
            for name in re.findall(r"\$\((\w+)\)", str(env.get("value", ""))):
                assert name in defined, (container["name"], env)
            defined.add(env["name"])
        for name in re.findall(r"\$\((\w+)\)", " ".join(argv(container))):
            assert name in defined, (container["name"], name)


def test_python_modules_exist_and_know_every_flag_given():
    modules = python_modules()
    assert {m for m, _ in modules} == {"openai_frontend", "launcher.dynamo_worker"}
    for module, args in modules:
        source = module_source(module)
        assert source is not None, f"no module {module} in the repository"
        text = source.read_text()
        known = set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", text))
        given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        assert given <= known, f"{module} has no flag {sorted(given - known)}"
        required = set(re.findall(r"""add_argument\(\s*["'](--[a-z0-9-]+)["'][^)]*required=True""", text))
        assert required <= given, f"{module} needs {sorted(required - given)}"


def test_tritonserver_runs_as_the_launcher_runs_it():
    """The launcher's command line, with the image's paths and the pod's address (the
    frontend and the kubelet reach tritonserver from outside the pod)."""
    install = TritonInstall(Path("/opt/tritonserver/bin/tritonserver"), Path("/opt/tritonserver/backends"))
    server = TritonServer("/unused", ports=TritonPorts(http=8000, grpc=8001, metrics=8002))
    expected = [a.replace(str(REPO_ROOT), IMAGE_ROOT).replace("=127.0.0.1", "=0.0.0.0") for a in server.argv(install)]
    tritonservers = [c for c in all_containers() if argv(c)[:1] == [str(install.tritonserver)]]
    assert len(tritonservers) == 2  # the chart's worker and the graph's
    for container in tritonservers:
        assert argv(container) == expected
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LLM_SOURCE_ROOT"] == IMAGE_ROOT and env["KV_EVENTS_ENDPOINT"] == "tcp://127.0.0.1:5557"
        assert env["LLM_MODEL_PATH"] == values()["model"]["path"]


def test_chart_and_graph_run_the_same_containers():
    """The graph is the chart for Dynamo's operator: the same commands and settings; only
    the addresses of nats and etcd (the operator's platform runs them) differ."""
    pods = chart_pods(render_chart())
    chart = {c["name"]: c for pod in pods.values() for c in pod["containers"]}
    pairs = {"Frontend": "frontend", "TritonWorker": "tritonserver", "dynamo-worker": "dynamo-worker"}
    for graph_name, container in graph_containers().items():
        twin = chart[pairs[graph_name]]
        assert argv(container) == argv(twin) and container["image"] == twin["image"], graph_name
        own = {e["name"]: e.get("value") for e in container["env"]}
        theirs = {e["name"]: e.get("value") for e in twin["env"] if e["name"] != "API_KEYS"}
        assert own.keys() == theirs.keys(), graph_name
        for name in own.keys() - {"NATS_SERVER", "ETCD_ENDPOINTS"}:
            assert own[name] == theirs[name], (graph_name, name)


def test_graph_is_a_dynamo_graph_deployment():
    doc = graph()
    assert (doc["apiVersion"], doc["kind"]) == ("nvidia.com/v1alpha1", "DynamoGraphDeployment")
    services = doc["spec"]["services"]
    for name, service in services.items():
        assert service.keys() <= GRAPH_SERVICE_FIELDS, f"{name}: fields not in Dynamo's examples"
        assert service["dynamoNamespace"] == values()["dynamo"]["namespace"]
    assert services["Frontend"]["componentType"] == "frontend"
    worker = services["TritonWorker"]
    assert (worker["componentType"], worker["replicas"]) == ("worker", 3)
    assert worker["resources"]["limits"]["gpu"] == "1"


def test_workers_ask_for_a_gpu_each():
    pods = chart_pods(render_chart())
    triton = next(c for c in pods[f"{RELEASE}-worker"]["containers"] if c["name"] == "tritonserver")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == "1"
    replicas = {o["metadata"]["name"]: o["spec"]["replicas"] for o in render_chart() if o["kind"] == "Deployment"}
    assert (replicas[f"{RELEASE}-worker"], replicas[f"{RELEASE}-frontend"]) == (3, 1)


def test_image_is_the_one_the_dockerfile_builds():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "docker build -t tritonllm ." in dockerfile and f"WORKDIR {IMAGE_ROOT}" in dockerfile
    assert "TRITONSERVER_BIN=/opt/tritonserver/bin/tritonserver" in dockerfile
    cache = re.search(r"LLM_CACHE_DIR=(\S+)", dockerfile)[1]
    image = values()["image"]
    assert image["repository"] == "tritonllm"
    assert {c["image"] for c in graph_containers().values()} == {f"{image['repository']}:{image['tag']}"}
    assert values()["model"]["path"].startswith(f"{cache}/models/")


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (not on PATH): the chart is checked by this test's renderer only")
    return path


@pytest.mark.parametrize("options", [{}, OPTIONS_ON], ids=["defaults", "options-on"])
def test_helm_lints_and_renders_as_this_test_does(options, tmp_path):
    helm = _need("helm")
    overrides = tmp_path / "values.yaml"
    overrides.write_text(yaml.safe_dump(options))
    subprocess.run([helm, "lint", str(CHART), "-f", str(overrides)], check=True, timeout=60)
    out = subprocess.run([helm, "template", RELEASE, str(CHART), "-f", str(overrides)],
                         check=True, timeout=60, capture_output=True, text=True).stdout  # fmt: skip
    key = lambda o: (o["kind"], o["metadata"]["name"])
    assert sorted(filter(None, yaml.safe_load_all(out)), key=key) == sorted(render_chart(options), key=key)


def test_kubeconform_validates_the_rendered_chart(tmp_path):
    """Against Kubernetes' schemas: kubeconform's default location (a download), or a local
    copy named by KUBECONFORM_SCHEMA_LOCATION."""
    kubeconform = _need("kubeconform")
    rendered = tmp_path / "chart.yaml"
    rendered.write_text(yaml.safe_dump_all(render_chart(OPTIONS_ON)))
    location = os.environ.get("KUBECONFORM_SCHEMA_LOCATION")
    command = [kubeconform, "-strict", "-summary", *(["-schema-location", location] if location else []), str(rendered)]
    subprocess.run(command, check=True, timeout=120)
