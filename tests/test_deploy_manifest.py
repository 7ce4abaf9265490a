"""The Kubernetes deployment's shape (``deploy/``): no Kubernetes API server runs here, so the
KubeRay ``RayJob`` is never applied; what can be checked without one is checked.

``problems`` reads the manifest and the container recipe the way KubeRay, the image build and
``tidal run`` would and lists what each would refuse or get wrong: the kind and API version,
an entrypoint that Tidal's own ``tidal run`` parser and ``JobSpec`` accept with the Ray
backend and an ``s3://`` checkpoint folder, one image for every Ray pod, resource requests
with limits at least as large, workers that fit the pods, Ray's token and the store's
credentials from Secrets, and an image that pins the tested torch and installs this project.
The real files have no problem; each fault in ``FAULTS`` makes ``problems`` name it."""

from __future__ import annotations

import copy
import math
import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tidal.checkpoint.location import is_url
from tidal.cli import build_parser
from tidal.config import JobSpec, from_flags, parse_schedule
from tidal.launch import checkpoint_storage
from tidal.policy.inputs import parse_duration

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")
SHELL = {"&&", "||", ";", "|", "&", ">", "<", ">>"}
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|ACCESS_KEY|PRIVATE", re.I)
MIN_AUTH_RAY = Version("2.52.0")  # KubeRay refuses authOptions.mode token below it


# -- reading --------------------------------------------------------------------------------
def quantity(text: object) -> float:
    """A Kubernetes quantity (``"500m"``, ``"2"``, ``"4Gi"``, ``"1G"``) as a number."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip
    found = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text).strip())
    if not found or found.group(2) not in {"", *units}:
        raise ValueError(f"not a quantity: {text!r}")
    return float(found.group(1)) * units.get(found.group(2), 1)


def dockerfile_lines(text: str) -> list[str]:
    """Its instructions, continuations joined, comments dropped, ``ARG`` defaults expanded."""
    lines, args, held = [], {}, ""
    for raw in text.splitlines():
        if not held and raw.lstrip().startswith("#"):
            continue
        held += raw.rstrip().removesuffix("\\") + " "
        if raw.rstrip().endswith("\\"):
            continue
        line, held = " ".join(held.split()), ""
        if not line:
            continue
        line = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), line)
        if line.startswith("ARG ") and "=" in line:
            name, _, value = line[4:].partition("=")
            args[name.strip()] = value.strip().strip('"')
        lines.append(line)
    return lines


def ray_containers(job: dict) -> list[tuple[str, dict, dict]]:
    """``(group, group spec, Ray container)`` for the head and each worker group: KubeRay
    runs Ray in each pod's first container."""
    cluster = job["spec"]["rayClusterSpec"]
    groups = [("head", cluster["headGroupSpec"])]
    groups += [(g.get("groupName", "?"), g) for g in cluster.get("workerGroupSpecs", [])]
    return [(name, g, g["template"]["spec"]["containers"][0]) for name, g in groups]


def all_containers(job: dict) -> list[dict]:
    found = [c for _, g, _ in ray_containers(job) for c in g["template"]["spec"]["containers"]]
    submitter = job["spec"].get("submitterPodTemplate")
    return found + (submitter["spec"]["containers"] if submitter else [])


def run_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["run"]


def job_spec(entrypoint: str) -> JobSpec:
    """The entrypoint read as ``tidal run`` reads its command line (``launch.cmd_run``'s
    conversions); ``ValueError`` for what it refuses."""
    words = shlex.split(entrypoint)
    if set(words) & SHELL:
        raise ValueError("the entrypoint must be one command (no shell operators)")
    if words[:2] != ["tidal", "run"]:
        raise ValueError(f"the entrypoint must be `tidal run ...`, got {words[:2]}")
    try:
        args = run_parser().parse_args(words[2:])
    except SystemExit:
        raise ValueError("the entrypoint does not parse as `tidal run`") from None
    if not args.name:
        raise ValueError("the entrypoint needs --name (the job is found by it later)")
    schedule = parse_schedule(args.schedule) if args.schedule else ()
    peak = max([args.workers, *(c for _, c in schedule)])
    return from_flags(
        JobSpec, vars(args), name=args.name, script=args.script,
        script_args=list(args.script_args),
        max_workers=args.max_workers if args.max_workers is not None else peak,
        schedule=schedule, capacity_trace=args.capacity,
        deadline_s=parse_duration(args.deadline) if args.deadline else None,
        checkpoint_storage=checkpoint_storage(args.checkpoint_dir), track=args.track,
    )  # fmt: skip


def ray_extra() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    (spec,) = re.findall(r'^ray = \["([^"]+)"\]', text, re.M)
    return Requirement(spec)


# -- the checks ---------------------------------------------------------------------------
def problems(job: dict, dockerfile: str, ignore: str) -> list[str]:
    """Everything wrong with the RayJob ``job`` and the recipe, one line each."""
    out: list[str] = []
    spec = job.get("spec", {})
    cluster = spec.get("rayClusterSpec", {})
    if job.get("apiVersion") != "ray.io/v1" or job.get("kind") != "RayJob":
        out.append(f"apiVersion/kind must be ray.io/v1 RayJob, got {job.get('apiVersion')} "
                   f"{job.get('kind')}")  # fmt: skip
    if spec.get("shutdownAfterJobFinishes") is not True:
        out.append("shutdownAfterJobFinishes must be true (the cluster goes when the job ends)")
    deadline = spec.get("activeDeadlineSeconds")
    if not isinstance(deadline, int) or deadline <= 0:
        out.append(f"activeDeadlineSeconds must be a positive int, got {deadline!r}")
    if spec.get("backoffLimit", 0) != 0:
        out.append("backoffLimit must be 0: a retry runs `tidal run` from step 0 again")

    try:
        js = job_spec(spec.get("entrypoint", ""))
    except (ValueError, TypeError) as exc:
        out.append(f"entrypoint: {exc}")
        js = None
    if js is not None:
        if js.backend != "ray":
            out.append(f"the entrypoint must run --backend ray, got {js.backend}")
        storage = js.checkpoint_storage or ""
        if not (is_url(storage) and storage.startswith("s3://")):
            out.append(f"--checkpoint-dir must be an s3:// URL (pods' disks go), got {storage!r}")
        if js.name != job.get("metadata", {}).get("name"):
            out.append(f"--name {js.name} must be the RayJob's name")

    images = {c.get("image") for _, _, c in ray_containers(job)}
    if len(images) != 1:
        out.append(f"the head and worker groups must run one image, got {sorted(images)}")
    for group, _, c in ray_containers(job):
        res = c.get("resources", {})
        for kind in ("cpu", "memory"):
            req, lim = res.get("requests", {}).get(kind), res.get("limits", {}).get(kind)
            if req is None or lim is None:
                out.append(f"{group}: {kind} needs requests and limits, got {req} / {lim}")
            elif quantity(lim) < quantity(req):
                out.append(f"{group}: {kind} limit {lim} is below its request {req}")
        names = {s["secretRef"]["name"] for s in c.get("envFrom", []) if "secretRef" in s}
        if js is not None and (js.checkpoint_storage or "").startswith("s3://") and not names:
            out.append(f"{group}: the object store's credentials must come from a Secret "
                       "(envFrom secretRef)")  # fmt: skip
    for c in all_containers(job):
        for e in c.get("env", []):
            literal = "value" in e or "secretKeyRef" not in e.get("valueFrom", {})
            if SECRET_NAME.search(e["name"]) and literal:
                out.append(f"{c['name']}: {e['name']} must come from a Secret (secretKeyRef)")

    auth = cluster.get("authOptions") or {}
    if auth.get("mode") != "token" or not auth.get("secretName"):
        out.append("authOptions must be mode: token with secretName (Ray's token, a Secret)")
    ray_version = str(cluster.get("rayVersion", "0"))
    if Version(ray_version) < MIN_AUTH_RAY:
        out.append(f"rayVersion {ray_version} is below {MIN_AUTH_RAY} (token authentication)")
    if js is not None:
        out += _capacity(job, js)
    out += _recipe(dockerfile, ignore, ray_version, js)
    return out


def _capacity(job: dict, js: JobSpec) -> list[str]:
    """Each worker fits a worker pod, the initial workers the initial pods, the most workers
    the most pods; the head hosts none (its pod is the coordinator's)."""
    out = []
    head, *workers = ray_containers(job)
    if head[1].get("rayStartParams", {}).get("num-cpus") != "0":
        out.append('head: rayStartParams num-cpus must be "0" (no Tidal worker on the head)')
    start = most = 0
    for group, g, c in workers:
        limits = c.get("resources", {}).get("limits", {})
        per_pod = math.floor(quantity(limits.get("cpu", 0)) / js.cluster.worker_cpus)
        if js.cluster.worker_gpus:
            gpus = quantity(limits.get("nvidia.com/gpu", 0))
            per_pod = min(per_pod, math.floor(gpus / js.cluster.worker_gpus))
        if per_pod < 1:
            out.append(f"{group}: a worker (--worker-cpus {js.cluster.worker_cpus:g}) does "
                       f"not fit a pod's limits {limits}")  # fmt: skip
        low, n, high = (g.get(k, 0) for k in ("minReplicas", "replicas", "maxReplicas"))
        if not low <= n <= high:
            out.append(f"{group}: need minReplicas <= replicas <= maxReplicas, got {low, n, high}")
        start, most = start + n * per_pod, most + high * per_pod
    if js.workers > start:
        out.append(f"--workers {js.workers} do not fit the {start} the initial pods hold")
    if js.max_workers > most:
        out.append(f"--max-workers {js.max_workers} do not fit the {most} the most pods hold")
    return out


def _recipe(dockerfile: str, ignore: str, ray_version: str, js: JobSpec | None) -> list[str]:
    out = []
    lines = dockerfile_lines(dockerfile)
    installs = " ".join(x for x in lines if x.startswith("RUN ") and "pip install" in x)
    (tested,) = set(re.findall(r"torch==([0-9.]+)", (ROOT / ".ci" / "run").read_text()))
    if not re.search(rf"\btorch=={re.escape(tested)}\b", installs):
        out.append(f"the image must pip install torch=={tested}, the build CI tests")
    if not re.search(r"\bdownload\.pytorch\.org/whl/cpu\b", installs):
        out.append("the image's default torch must be the CPU build (PyTorch's cpu index)")
    if not any(re.fullmatch(r"FROM python:3\.11-slim\S*", x) for x in lines):
        out.append("the image must start FROM python:3.11-slim")
    extras = re.search(r"[\"' ]\.\[([\w,]+)\]", installs)
    if not extras or not {"ray", "s3"} <= set(extras.group(1).split(",")):
        out.append("the image must pip install this project (.) with its ray and s3 extras")
    if f"ray[default]=={ray_version}" not in installs:
        out.append(f"the image must install ray[default]=={ray_version} (the rayVersion)")
    if not ray_extra().specifier.contains(ray_version):
        out.append(f"rayVersion {ray_version} is outside the [ray] extra's {ray_extra()}")
    workdir = next((x[8:] for x in lines if x.startswith("WORKDIR ")), "/")
    copied = {w for x in lines if x.startswith("COPY ") for w in x.split()[1:-1]}
    kept = {x.strip().removeprefix("!").rstrip("/") for x in ignore.splitlines()
            if x.strip().startswith("!")}  # fmt: skip
    if not {"pyproject.toml", "tidal"} <= copied:
        out.append("the image must COPY pyproject.toml and tidal/ (the project's source)")
    if copied - kept:
        out.append(f"Dockerfile.dockerignore leaves out what the image copies: {copied - kept}")
    if js is not None:
        script = Path(js.script)
        inside = script.is_relative_to(workdir) and script.relative_to(workdir)
        if not inside or inside.parts[0] not in copied or not (ROOT / inside).is_file():
            out.append(f"the entrypoint's script {script} is not in the image")
    return out


# -- the tests ----------------------------------------------------------------------------
def _real() -> tuple[dict, str, str]:
    return yaml.safe_load(MANIFEST.read_text()), DOCKERFILE.read_text(), IGNORE.read_text()


def test_the_manifest_and_the_recipe_have_no_problem():
    job, dockerfile, ignore = _real()
    assert problems(job, dockerfile, ignore) == []
    js = job_spec(job["spec"]["entrypoint"])  # what the test above accepted, for the record
    assert (js.backend, js.workers, js.max_workers) == ("ray", 2, 4)
    assert js.checkpoint_storage == "s3://YOUR-BUCKET/tidal" and js.checkpoints


def _entry(old: str, new: str):
    def change(job, dockerfile, ignore):
        assert old in job["spec"]["entrypoint"]
        job["spec"]["entrypoint"] = job["spec"]["entrypoint"].replace(old, new)

    return change


def _set(path: str, value):
    """Set ``job[...]`` at a dotted path (``-`` deletes); digits index lists."""

    def change(job, dockerfile, ignore):
        *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = job
        for key in parents:
            node = node[key]
        if value == "-":
            del node[last]
        else:
            node[last] = value

    return change


def _docker(old: str, new: str):
    def change(job, dockerfile, ignore):
        assert old in dockerfile
        return dockerfile.replace(old, new), ignore

    return change


HEAD = "spec.rayClusterSpec.headGroupSpec"
WORKER = "spec.rayClusterSpec.workerGroupSpecs.0"
W_CONTAINER = f"{WORKER}.template.spec.containers.0"
FAULTS = {
    "kind": (_set("kind", "RayCluster"), "apiVersion/kind"),
    "api version": (_set("apiVersion", "ray.io/v1alpha1"), "apiVersion/kind"),
    "local backend": (_entry("--backend ray", "--backend local"), "--backend ray"),
    "unknown flag": (_entry("--workers 2", "--wrokers 2"), "does not parse"),
    "not tidal run": (_entry("tidal run", "python -m tidal run"), "`tidal run ...`"),
    "two commands": (_entry("--max-steps 2000", "--max-steps 2000 && sleep 1"), "one command"),
    "no checkpoint cadence": (_entry("--checkpoint-every 100 ", ""), "needs --checkpoint-every"),
    "folder checkpoints": (_entry("s3://YOUR-BUCKET/tidal", "/ckpt"), "s3:// URL"),
    "other name": (_entry("--name tidal-digits", "--name other"), "RayJob's name"),
    "missing script": (_entry("digits.py", "nosuch.py"), "not in the image"),
    "worker too big": (_entry("--worker-cpus 2", "--worker-cpus 3"), "does not fit a pod"),
    "too many workers": (_entry("--max-workers 4", "--max-workers 5"), "--max-workers 5"),
    "too many at start": (_entry("--workers 2", "--workers 3"), "--workers 3"),
    "two images": (_set(f"{W_CONTAINER}.image", "other:1"), "one image"),
    "no requests": (_set(f"{W_CONTAINER}.resources.requests", "-"), "needs requests"),
    "limit below request": (_set(f"{W_CONTAINER}.resources.limits.memory", "1Gi"), "below"),
    "workers on the head": (_set(f"{HEAD}.rayStartParams", {}), "num-cpus"),
    "replicas past max": (_set(f"{WORKER}.replicas", 5), "replicas <= maxReplicas"),
    "cluster kept": (_set("spec.shutdownAfterJobFinishes", False), "shutdownAfterJobFinishes"),
    "no deadline": (_set("spec.activeDeadlineSeconds", "-"), "activeDeadlineSeconds"),
    "retries": (_set("spec.backoffLimit", 2), "backoffLimit"),
    "no token": (_set("spec.rayClusterSpec.authOptions", "-"), "authOptions"),
    "token in the open": (
        _set(f"{W_CONTAINER}.env", [{"name": "RAY_AUTH_TOKEN", "value": "t0ken"}]),
        "Secret",
    ),
    "no store credentials": (_set(f"{W_CONTAINER}.envFrom", "-"), "credentials"),
    "old ray": (_set("spec.rayClusterSpec.rayVersion", "2.51.0"), "rayVersion 2.51.0"),
    "other ray": (_set("spec.rayClusterSpec.rayVersion", "2.61.0"), "ray[default]==2.61.0"),
    "other torch": (_docker("TORCH_VERSION=2.13.0", "TORCH_VERSION=2.12.0"), "torch==2.13.0"),
    "cuda torch": (_docker("whl/cpu", "whl/cu128"), "CPU build"),
    "other python": (_docker("python:3.11-slim", "python:3.12-slim"), "python:3.11"),
    "project not installed": (_docker(' ".[${TIDAL_EXTRAS}]"', ""), "this project"),
    "source ignored": (lambda job, d, i: (d, i.replace("!examples/\n", "")), "leaves out"),
}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_each_fault_is_named(fault):
    job, dockerfile, ignore = _real()
    job = copy.deepcopy(job)
    change, says = FAULTS[fault]
    changed = change(job, dockerfile, ignore)
    if changed is not None:
        dockerfile, ignore = changed
    found = problems(job, dockerfile, ignore)
    assert any(says in p for p in found), found


def test_the_docs_create_the_secrets_the_manifest_reads():
    job, _, _ = _real()
    docs = (ROOT / "docs" / "clusters.md").read_text()
    section = docs[docs.index("## Kubernetes (KubeRay)") :]
    token = job["spec"]["rayClusterSpec"]["authOptions"]["secretName"]
    assert re.search(rf"kubectl create secret generic {token} \\?\s*--from-\w+=auth_token=",
                     section), token  # fmt: skip
    stores = {s["secretRef"]["name"] for _, _, c in ray_containers(job) for s in c["envFrom"]}
    for name in stores:
        assert f"kubectl create secret generic {name}" in section, name
    assert "kubectl apply -f deploy/kuberay/rayjob.yaml" in section
    assert "docker build -f deploy/container/Dockerfile" in section


def test_quantities_and_dockerfile_lines_read_as_kubernetes_and_docker_do():
    assert [quantity(q) for q in ("500m", "2", "4Gi", "1G", "1.5")] == [
        0.5, 2.0, 4 * 2**30, 1e9, 1.5]  # fmt: skip
    with pytest.raises(ValueError):
        quantity("4GB")
    text = "ARG V=1\n# c\nRUN pip install \\\n    a==${V} b==$V\n"
    assert dockerfile_lines(text) == ["ARG V=1", "RUN pip install a==1 b==1"]
