"""Checks of deploy/ that need none of the systems it targets (no Slurm, Kubernetes, Docker here).

Scripts parse (bash -n) and pass shellcheck; YAML and JSON parse and hang together (selectors match
labels, the ConfigMap's cluster file loads, node names match the StatefulSet); every metric the
Grafana dashboard queries exists in the metric factories; the example cluster file loads and
documents every setting; the systemd unit has what a node needs and passes systemd-analyze.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from luwu.config import _sections, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPTS = sorted([*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch")])
YAMLS = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSONS = sorted(DEPLOY.rglob("*.json"))

try:
    import yaml
except ImportError:  # PyYAML is a test dependency; without it the YAML checks skip and say so
    yaml = None
needs_yaml = pytest.mark.skipif(
    yaml is None, reason="PyYAML is not installed: pip install pyyaml (it is in luwu-runtime[test])"
)


def test_deploy_tree_is_complete():
    expected = [
        "README.md",
        "cluster.example.toml",
        "local.sh",
        "train_example.py",
        "ssh/launch.sh",
        "ssh/hosts.example",
        "slurm/luwu.sbatch",
        "systemd/luwu-node@.service",
        "k8s/luwu-nodes.yaml",
        "k8s/luwu-train-job.yaml",
        "k8s/luwu-aggregators.yaml",
        "docker/Dockerfile",
        "prometheus/prometheus.yml",
        "grafana/luwu-dashboard.json",
    ]
    missing = [p for p in expected if not (DEPLOY / p).is_file()]
    assert not missing, f"missing from deploy/: {missing}"
    for script in SCRIPTS:
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        assert script.read_text().startswith("#!"), f"{script} has no #! line"


# ----------------------------------------------------------------- shell


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"bash -n {script}:\n{r.stderr}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_scripts_pass_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip(
            "shellcheck is not installed: apt-get install shellcheck (scripts/setup.sh does it)"
        )
    r = subprocess.run(
        ["shellcheck", "--shell=bash", "--severity=style", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"shellcheck {script}:\n{r.stdout}{r.stderr}"


def test_scripts_explain_themselves():
    """`help` prints the usage block of the script; a typo'd command is refused with it (exit 2)."""
    for script in (DEPLOY / "local.sh", DEPLOY / "ssh" / "launch.sh"):
        r = subprocess.run([str(script), "help"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and ("down" in r.stdout or "stop" in r.stdout), (script, r)
        bad = subprocess.run(
            [str(script), "no-such-command"], capture_output=True, text=True, timeout=30
        )
        assert bad.returncode == 2, (script, bad)


def test_sbatch_directives_precede_commands():
    """sbatch stops reading #SBATCH lines at the first command: they must all come before it."""
    lines = (DEPLOY / "slurm" / "luwu.sbatch").read_text().splitlines()
    first_cmd = next(
        i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#")
    )
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_cmd
    text = "\n".join(lines)
    for needed in (
        "srun",
        "torch.distributed.run",
        "--rdzv-backend=c10d",
        "scontrol show hostnames",
        "luwu.status status",
        "--node.index",
    ):
        assert needed in text, needed


# ----------------------------------------------------------------- YAML / JSON


@needs_yaml
@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} is empty"


@pytest.mark.parametrize("path", JSONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path):
    assert json.loads(path.read_text())


@needs_yaml
def test_prometheus_config_shape():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert {"luwu-nodes", "luwu-workers"} <= set(jobs)
    assert (
        "targets.json" in jobs["luwu-nodes"]["file_sd_configs"][0]["files"][0]
    )  # what `luwu up` writes


def test_prometheus_config_passes_promtool(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed: apt-get install prometheus (it ships promtool)")
    r = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _k8s_docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            if d:
                assert {"apiVersion", "kind", "metadata"} <= set(d), (
                    f"{path}: {d.get('kind')} lacks apiVersion/kind/metadata"
                )
                out[(d["kind"], d["metadata"]["name"])] = d
    return out


@needs_yaml
def test_k8s_manifests_hang_together(tmp_path):
    docs = _k8s_docs()
    kinds = {k for k, _ in docs}
    assert {"ConfigMap", "Service", "StatefulSet", "Job"} <= kinds, kinds
    sts = next(d for (k, _), d in docs.items() if k == "StatefulSet")
    svc = docs[("Service", sts["spec"]["serviceName"])]
    assert svc["spec"]["clusterIP"] == "None", (
        "the StatefulSet's service must be headless (per-pod DNS names)"
    )
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    # The cluster file in the ConfigMap loads, and its nodes are exactly the StatefulSet's pods.
    cm_name = next(
        v["configMap"]["name"]
        for v in sts["spec"]["template"]["spec"]["volumes"]
        if "configMap" in v
    )
    (tmp_path / "cluster.toml").write_text(docs[("ConfigMap", cm_name)]["data"]["cluster.toml"])
    cfg = load_config(str(tmp_path / "cluster.toml"), env={})
    name, svc_name, replicas = (
        sts["metadata"]["name"],
        svc["metadata"]["name"],
        sts["spec"]["replicas"],
    )
    assert [re.match(r"tcp://([^.:]+)\.([^.:]+)", a).groups() for a in cfg.cluster.nodes] == [
        (f"{name}-{i}", svc_name) for i in range(replicas)
    ]
    node_args = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (
        "--node.index" in node_args
        and "--node.bind" in node_args
        and "terminationGracePeriodSeconds" in sts["spec"]["template"]["spec"]
    )
    # Workers: an Indexed Job whose torchrun --nnodes is its completion count, reachable through a headless Service.
    job = next(d for (k, _), d in docs.items() if k == "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    worker_args = " ".join(spec["template"]["spec"]["containers"][0]["args"])
    assert (
        "torch.distributed.run" in worker_args and f"--nnodes={spec['completions']}" in worker_args
    )
    sub = spec["template"]["spec"]["subdomain"]
    assert docs[("Service", sub)]["spec"]["clusterIP"] == "None"
    assert f"--master-addr={job['metadata']['name']}-0.{sub}" in worker_args
    assert any(
        v.get("configMap", {}).get("name") == cm_name for v in spec["template"]["spec"]["volumes"]
    )


# ----------------------------------------------------------------- Grafana vs the metric factories


def exposed_series() -> set[str]:
    """Every sample name the factories can expose, from fresh registries (counters as _total,
    histograms as _bucket/_sum/_count, plus _created)."""
    import torch

    from luwu.gpu_workers.metrics import WorkerMetrics
    from luwu.gpu_workers.prefetch import Prefetcher
    from luwu.switch_nodes.metrics import NodeMetrics

    registries = [
        NodeMetrics(CollectorRegistry()).registry,
        WorkerMetrics(CollectorRegistry()).registry,
    ]
    reg = CollectorRegistry()
    Prefetcher(
        [torch.zeros(1)], registry=reg
    ).close()  # the prefetch metrics are made by the Prefetcher
    registries.append(reg)
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("", "_sum", "_count", "_created"),
    }
    out = set()
    for r in registries:
        for family in r.collect():
            out.update(family.name + s for s in suffixes[family.type])
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "luwu-dashboard.json").read_text())
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))

    walk(dash["panels"])
    return out


def test_dashboard_metrics_exist():
    exposed = exposed_series()
    assert any(n.startswith("luwu_prefetch_") for n in exposed)
    exprs = dashboard_exprs()
    used = {
        (name, title)
        for title, expr in exprs
        for name in re.findall(r"\bluwu_[a-z0-9_]+\b(?!\s*[=!]~?\s*\")", expr)
    }
    assert len({n for n, _ in used}) >= 20
    unknown = sorted({f"{name} (panel {title!r})" for name, title in used if name not in exposed})
    assert not unknown, f"the dashboard queries metrics no factory makes: {unknown}"


def test_dashboard_covers_what_operators_need():
    dash = json.loads((DEPLOY / "grafana" / "luwu-dashboard.json").read_text())
    exprs = " ".join(e for _, e in dashboard_exprs())
    for needed in (
        "luwu_node_step",
        "luwu_worker_bytes_pushed_total",
        "luwu_worker_bytes_pulled_total",
        "luwu_worker_raw_bytes_pushed_total",
        "luwu_node_optimizer_step_seconds_bucket",
        "luwu_node_aggregation_wait_seconds_bucket",
        "luwu_worker_compute_seconds_sum",
        "luwu_worker_push_wait_seconds_sum",
        "luwu_worker_update_wait_seconds_sum",
        "luwu_worker_data_wait_seconds_sum",
        "luwu_node_errors_total",
        "luwu_node_connected_workers",
        "luwu_node_checkpoint_age_seconds",
    ):
        assert needed in exprs, f"dashboard lacks {needed}"
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs
    assert "sum by (code)" in exprs
    ids = []

    def walk(panels):
        for p in panels:
            ids.append(p["id"])
            assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
                "w"
            ] <= 24, p["title"]
            if p["type"] != "row":
                assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
            walk(p.get("panels", []))

    walk(dash["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert any(v["type"] == "datasource" for v in dash["templating"]["list"])


# ----------------------------------------------------------------- cluster file, systemd, Docker


def test_example_cluster_file_loads_and_documents_every_setting():
    path = DEPLOY / "cluster.example.toml"
    cfg = load_config(str(path), env={})
    assert len(cfg.cluster.nodes) == 2
    present: dict[str, set[str]] = {}
    section = None
    for line in path.read_text().splitlines():
        m = re.match(r"^\[(\w+)\]", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^#?\s*(\w+)\s*=", line)
        if m and section:
            present.setdefault(section, set()).add(m.group(1))
    sections = _sections()
    assert set(present) == set(sections), (
        f"sections: file has {sorted(present)}, the config tree {sorted(sections)}"
    )
    missing = [
        f"{s}.{f.name}"
        for s, cls in sections.items()
        for f in dataclasses.fields(cls)
        if f.name not in present[s]
    ]
    assert not missing, f"deploy/cluster.example.toml does not mention {missing}"


def _unit() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # systemd keys are case-sensitive
    cp.read_string((DEPLOY / "systemd" / "luwu-node@.service").read_text())
    return cp


def test_systemd_unit_keys():
    u = _unit()
    assert u["Unit"]["Description"] and "network-online.target" in u["Unit"]["After"]
    s = u["Service"]
    assert (
        "-m luwu" in s["ExecStart"]
        and " node " in s["ExecStart"]
        and "--node.index %i" in s["ExecStart"]
    )
    assert "--config" in s["ExecStart"] and s["EnvironmentFile"].lstrip("-").endswith("node-%i.env")
    assert s["Restart"] == "on-failure" and float(s["RestartSec"]) > 0
    assert s["KillSignal"] == "SIGTERM"
    assert int(s["TimeoutStopSec"]) >= 60, (
        "the node writes a checkpoint on SIGTERM: give it time before SIGKILL"
    )
    assert s["User"] != "root"
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_unit_verifies(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    unit = tmp_path / "luwu-node@0.service"
    shutil.copy(DEPLOY / "systemd" / "luwu-node@.service", unit)
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    # The only complaint allowed here: the venv of ExecStart is not installed on this machine.
    problems = [
        line
        for line in (r.stdout + r.stderr).splitlines()
        if line.strip() and "is not executable" not in line
    ]
    assert not problems, "\n".join(problems)


def test_dockerfile_installs_cpu_torch_first_and_runs_unprivileged():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "FROM python:3.11-slim"
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_line]
    package_line = next(
        i for i, line in enumerate(lines) if re.search(r"pip install \.(\s|$)", line)
    )
    assert torch_line < package_line, (
        "torch must be installed before the package (else pip pulls a CUDA build)"
    )
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    # A C compiler for the codec kernels, or every node and worker runs the slower torch path.
    assert re.search(r"apt-get install .*\bgcc\b", text), (
        "the image needs gcc for protocol/blockquant.c"
    )
    # Every source folder the package maps (pyproject package-dir) is copied into the image.
    for folder in ("luwu", "protocol", "switch_nodes", "gpu_workers"):
        assert re.search(rf"^COPY {folder} ", text, re.M), folder


# ----------------------------------------------------------------- packaging


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())


def test_requires_python_is_what_the_code_needs():
    """luwu.config reads TOML with tomllib (3.11+): the metadata says so, or a tomli fallback exists."""
    project = _pyproject()["project"]
    config = (DEPLOY.parent / "luwu" / "config.py").read_text()
    has_fallback = "import tomli" in config and "tomli" in " ".join(project["dependencies"])
    assert has_fallback or project["requires-python"].replace(" ", "") in (">=3.11", ">=3.11,<4")


def test_the_wheel_ships_the_example_and_the_typing_marker():
    tool = _pyproject()["tool"]["setuptools"]
    assert "luwu.deploy" in tool["packages"] and tool["package-dir"]["luwu.deploy"] == "deploy"
    assert (DEPLOY / "__init__.py").is_file() and (DEPLOY / "train_example.py").is_file(), (
        "train_example.py ships as a module of luwu.deploy"
    )
    data = tool["package-data"]
    assert "cluster.example.toml" in data["luwu.deploy"] and "README.md" in data["luwu.deploy"]
    assert "py.typed" in data["luwu"] and (DEPLOY.parent / "luwu" / "py.typed").is_file()
    folders = {
        pkg: DEPLOY.parent / tool["package-dir"].get(pkg, pkg.replace(".", "/"))
        for pkg in tool["packages"]
    }
    for pkg, folder in folders.items():  # luwu.cli has no package-dir entry: it lives under luwu/
        if pkg not in tool["package-dir"]:
            folder = folders[pkg.rpartition(".")[0]] / pkg.rpartition(".")[2]
        assert (folder / "__init__.py").is_file(), pkg
    assert any(dep.startswith("tomli-w") for dep in _pyproject()["project"]["dependencies"]), (
        "config show writes TOML with tomli-w"
    )


def test_systemd_unit_points_only_at_what_is_installed():
    text = (DEPLOY / "systemd" / "luwu-node@.service").read_text()
    assert "/opt/luwu/deploy" not in text


# ----------------------------------------------------------------- CURVE by default in the recipes


def _code_lines(path: Path) -> list[str]:
    return [
        line
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize(
    "path",
    [
        *SCRIPTS,
        DEPLOY / "docker" / "Dockerfile",
        DEPLOY / "systemd" / "luwu-node@.service",
        DEPLOY / "k8s" / "luwu-nodes.yaml",
        DEPLOY / "k8s" / "luwu-aggregators.yaml",
    ],
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_no_recipe_turns_encryption_off_by_itself(path):
    """insecure_public_bind is an opt-out the operator asks for (LUWU_INSECURE_PUBLIC_BIND=1), never the default."""
    for line in _code_lines(path):
        assert "--node.insecure_public_bind" not in line, f"{path.name}: {line.strip()}"


@pytest.mark.parametrize("name", ["slurm/luwu.sbatch", "ssh/launch.sh"])
def test_network_scripts_make_keys_and_keep_them_off_argv(name):
    code = "\n".join(_code_lines(DEPLOY / name))
    assert "-m luwu keys --out" in code and "--cluster" in code, (
        "the job's keys are made by luwu keys"
    )
    assert re.search(r"\. \S*node\.env", code), "the node's shell reads the keys from node.env"
    assert "curve_secret_key" not in code.lower().replace("luwu_node__curve_secret_key", ""), (
        "no key on a command line"
    )
    assert "monitor.toml" in code or "status_file" in code, "status talks CURVE too"
    assert "LUWU_INSECURE_PUBLIC_BIND" in code and "WARNING" in code


def test_systemd_unit_reads_the_keys_from_an_environment_file():
    text = (DEPLOY / "systemd" / "luwu-node@.service").read_text()
    assert (
        "EnvironmentFile=-/etc/luwu/keys.env" in text
        and "install -m 600 keys/node.env /etc/luwu/keys.env" in text
    )


@needs_yaml
def test_k8s_pods_take_their_keys_from_a_secret():
    docs = _k8s_docs()
    for kind, secret, mount, arg in (
        ("StatefulSet", "luwu-keys", "/etc/luwu-keys", "/etc/luwu-keys/node.env"),
        (
            "Job",
            "luwu-worker-keys",
            "/etc/luwu-worker-keys",
            "/etc/luwu-worker-keys/worker${RANK}.toml",
        ),
    ):
        spec = next(d for (k, _), d in docs.items() if k == kind)["spec"]["template"]["spec"]
        volume = next(v for v in spec["volumes"] if "secret" in v)
        assert volume["secret"]["secretName"] == secret and volume["secret"]["defaultMode"] == 0o440
        container = spec["containers"][0]
        assert any(
            m["name"] == volume["name"] and m["mountPath"] == mount
            for m in container["volumeMounts"]
        )
        assert arg in " ".join(container["args"]) and "secret_key" not in " ".join(
            container["args"]
        )


# The operator's steps of a manifest's header, run here: `luwu keys` or `python -m luwu.deploy.join`
# for real, `kubectl` a stand-in with no API server (get configmap prints a ConfigMap of the
# manifests, create secret generic keeps the files kubectl would put in the Secret, keyed as it keys
# them; anything else does nothing).
KUBECTL_SHIM = r"""
import json, os, re, sys
from pathlib import Path

state, args = Path(os.environ["K8S_STATE"]), sys.argv[1:]
if args[:2] == ["get", "configmap"]:
    path = args[args.index("-o") + 1].removeprefix("jsonpath=")
    key = re.fullmatch(r"\{\.data\.(.+)\}", path).group(1).replace("\\.", ".")
    sys.stdout.write(json.loads((state / "configmaps.json").read_text())[args[2]][key])
elif args[:3] == ["create", "secret", "generic"]:
    name, files = args[3], {}
    out = state / "secrets" / name
    if out.exists():
        sys.exit(f'error: secrets "{name}" already exists')
    for arg in args[4:]:
        if not arg.startswith("--from-file="):
            sys.exit(f"kubectl stand-in: {arg} not understood")
        key, eq, src = arg.removeprefix("--from-file=").partition("=")
        if not eq:
            key, src = "", key
        src = Path(src)
        if src.is_dir():  # every regular file of the folder, keyed by its name
            files.update({f.name: f.read_bytes() for f in src.iterdir() if f.is_file()})
        else:
            files[key or src.name] = src.read_bytes()
    out.mkdir(parents=True)
    for key, data in files.items():
        (out / key).write_bytes(data)
"""


def _header_blocks(path: Path) -> list[list[str]]:
    """The command blocks of a manifest's comments: each run of lines indented under '#'."""
    blocks, block = [], []
    for line in [*path.read_text().splitlines(), ""]:
        if line.startswith("#   "):
            block.append(line[4:])
        elif block:
            blocks.append(block)
            block = []
    return blocks


def _operator_steps(tmp_path: Path, docs: dict, manifest: str, variant: str) -> dict[str, Path]:
    """Runs the steps of ``manifest``'s header for ``variant`` (curve: its `luwu keys` block;
    join-secret: the steps of that block that fetch the cluster file, then its
    `luwu.deploy.join` block) in a folder; returns each Secret they made (name: a folder of its
    files, named by their keys)."""
    blocks = _header_blocks(DEPLOY / "k8s" / manifest)
    curve = next((b for b in blocks if any(s.startswith("luwu keys ") for s in b)), None)
    assert curve, f"{manifest}: no `luwu keys` steps in its header"
    if variant == "curve":
        steps = curve
    else:
        join = next((b for b in blocks if any("luwu.deploy.join" in s for s in b)), None)
        assert join, f"{manifest}: no `python -m luwu.deploy.join` steps in its header"
        steps = [
            *curve[: next(i for i, s in enumerate(curve) if s.startswith("luwu keys "))],
            *join,
        ]
    work, state, bin_dir = tmp_path / "operator", tmp_path / "k8s-state", tmp_path / "operator-bin"
    for d in (work, state, bin_dir):
        d.mkdir()
    maps = {n: d["data"] for (k, n), d in docs.items() if k == "ConfigMap"}
    (state / "configmaps.json").write_text(json.dumps(maps))
    (bin_dir / "kubectl.py").write_text(KUBECTL_SHIM)
    for name, command in (
        ("kubectl", f'exec "{sys.executable}" "{bin_dir}/kubectl.py" "$@"'),
        ("luwu", f'exec "{sys.executable}" -m luwu "$@"'),
        ("python", f'exec "{sys.executable}" "$@"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{command}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", K8S_STATE=str(state))
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(steps)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, "\n".join(steps) + "\n" + r.stdout + r.stderr
    return {d.name: d for d in sorted((state / "secrets").iterdir())}


def _secret_views(pod: dict, secrets: dict[str, Path]) -> dict[str, dict[str, dict[str, bytes]]]:
    """What each container of ``pod`` (init containers too) sees of the Secrets, by mount path:
    {container: {mountPath: {file name: bytes}}}, as the kubelet projects a Secret volume (every
    key, or its ``items`` alone, each at its ``path``), a projected volume's Secret sources and a
    mount's ``subPath``. Every Secret a volume names must be one the steps made."""

    def files(source: dict) -> dict[str, bytes]:
        name = source.get("secretName", source.get("name"))
        assert name in secrets, f"Secret {name}: no header's steps make it"
        have = {f.name: f.read_bytes() for f in secrets[name].iterdir()}
        if "items" not in source:
            return have
        return {item["path"]: have[item["key"]] for item in source["items"]}

    volumes = {}
    for v in pod.get("volumes", []):
        if "secret" in v:
            volumes[v["name"]] = files(v["secret"])
        elif "projected" in v:
            shown = {}
            for s in v["projected"]["sources"]:
                shown.update(files(s["secret"]) if "secret" in s else {})
            volumes[v["name"]] = shown
    views = {}
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        seen = {}
        for m in c.get("volumeMounts", []):
            if m["name"] in volumes:
                shown = volumes[m["name"]]
                if "subPath" in m:
                    shown = {Path(m["subPath"]).name: shown[m["subPath"]]}
                seen[m["mountPath"]] = shown
        views[c["name"]] = seen
    return views


def _node_keys(node_pod: dict, secrets: dict[str, Path], tmp_path: Path) -> tuple[str, dict, dict]:
    """The Secret the node pods source node.env from, that file's variables, and what the node
    container sees of the Secrets (by mount path)."""
    from luwu.ops.keyset import read_env_file

    container = node_pod["containers"][0]
    env_path = Path(re.search(r"\. (/\S+/node\.env)", " ".join(container["args"])).group(1))
    views = _secret_views(node_pod, secrets)[container["name"]]
    (tmp_path / "node.env").write_bytes(views[str(env_path.parent)]["node.env"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(env_path.parent))
    volume = next(v for v in node_pod["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"], read_env_file(tmp_path / "node.env"), views


@needs_yaml
@pytest.mark.parametrize("variant", ["curve", "join-secret"])
@pytest.mark.parametrize("manifest", ["luwu-nodes.yaml", "luwu-aggregators.yaml"])
def test_k8s_worker_pods_never_see_the_nodes_keys(tmp_path, manifest, variant):
    """A node never shares its secret key with the workers. The Secrets made by the steps of the
    header (the nodes', or the switch tier's), mounted as the train Job mounts them: no Secret
    volume of the worker pod is the one the nodes source node.env from, no container of it sees a
    node.env, the nodes' secret key or an aggregator's keys, and each rank finds at its --config
    its own file: worker<r>.toml with the key pair the nodes let in as rank r, or join.toml with
    the nodes' join secret. The node pods see node.env alone (no worker's secret key)."""
    from luwu.ops.keyset import read_env_file

    docs = _k8s_docs()
    secrets = _operator_steps(tmp_path, docs, manifest, variant)
    node_pod = docs[("StatefulSet", "luwu-node")]["spec"]["template"]["spec"]
    job = docs[("Job", "luwu-train")]
    job_pod = job["spec"]["template"]["spec"]

    node_secret, node_env, node_views = _node_keys(node_pod, secrets, tmp_path)

    # The worker pod: no Secret of the nodes, nothing of theirs or of the aggregators' in any file.
    forbidden = [v for k, v in node_env.items() if "SECRET_KEY" in k]  # CURVE: the nodes' key
    aggregator_dir = secrets.get("luwu-tier-keys")
    for f in aggregator_dir.iterdir() if aggregator_dir else []:
        if f.name.startswith("aggregator") and f.suffix == ".env":
            forbidden += [v for k, v in read_env_file(f).items() if "SECRET_KEY" in k]
    for v in job_pod["volumes"]:
        sources = [v["secret"]] if "secret" in v else []
        sources += [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
        for s in sources:
            assert s.get("secretName", s.get("name")) != node_secret or (
                "items" in s and "node.env" not in {i["key"] for i in s["items"]}
            ), f"volume {v['name']} mounts {node_secret}, the nodes' node.env"
    views = _secret_views(job_pod, secrets)
    assert views, "the worker pod has containers"
    for container, mounts in views.items():
        for mount, files in mounts.items():
            for name, data in files.items():
                assert name != "node.env", f"{container} sees {mount}/node.env"
                assert not name.startswith("aggregator"), f"{container} sees {mount}/{name}"
                text = data.decode()
                assert not [k for k in forbidden if k in text], (
                    f"{container} sees the nodes' or an aggregator's secret key in {mount}/{name}"
                )

    assert [sorted(files) for files in node_views.values()] == [["node.env"]], (
        "the node pods get node.env alone: no worker's or aggregator's secret key, no monitor.toml"
    )
    # ... and each rank its own file where its --config points.
    worker = job_pod["containers"][0]
    args = " ".join(worker["args"])
    config = re.search(r'--config "(/\S+)"', args).group(1)
    shown = views[worker["name"]][str(Path(config).parent)]
    if variant == "join-secret":  # every rank uses join.toml instead of worker${RANK}.toml
        (tmp_path / "join.toml").write_bytes(shown["join.toml"])
        cfg = load_config(str(tmp_path / "join.toml"), env={})
        assert cfg.transport.join_secret == node_env["LUWU_NODE__JOIN_SECRET"]
        return
    ranks = job["spec"]["completions"] * int(re.search(r"--nproc-per-node=(\d+)", args).group(1))
    authorized = node_env["LUWU_NODE__CURVE_AUTHORIZED_KEYS"].split(",")
    for rank in range(ranks):
        name = Path(config.replace("${RANK}", str(rank))).name
        (tmp_path / name).write_bytes(shown[name])
        cfg = load_config(str(tmp_path / name), env={})
        assert cfg.transport.curve_public_key == authorized[rank]
        assert cfg.transport.curve_server_key == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
        assert cfg.cluster.nodes, "the worker's file holds the cluster file too"


# ----------------------------------------------------------------- one join secret per job (deploy/join.py)


def test_join_files_give_the_nodes_workers_and_status_one_secret(tmp_path, monkeypatch):
    """`python -m luwu.deploy.join KEYS CLUSTER`: node.env for every node, join.toml for every worker,
    monitor.toml for status, one secret, mode 600; a second start keeps it; LUWU_NODE__JOIN_SECRET wins."""
    from luwu.deploy.join import main, write_job_join_files
    from luwu.ops.keyset import read_env_file
    from luwu.protocol.errors import ConfigError

    for name in ("LUWU_NODE__JOIN_SECRET", "LUWU_TRANSPORT__JOIN_SECRET"):
        monkeypatch.delenv(name, raising=False)
    cluster, keys = tmp_path / "cluster.toml", tmp_path / "run" / "keys"
    cluster.write_text(
        '[cluster]\njob = "dj"\nnodes = ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]\n\n[optimizer]\nname = "sgd"\n'
    )
    keys.mkdir(parents=True)
    (keys / "worker0.toml").write_text("keys")  # a folder of CURVE keys is not mixed with a secret
    with pytest.raises(ConfigError, match="holds CURVE keys"):
        write_job_join_files(keys, cluster)
    (keys / "worker0.toml").unlink()
    secret, files = write_job_join_files(keys, cluster)
    assert (
        sorted(f.name for f in keys.iterdir())
        == ["join.toml", "monitor.toml", "node.env"]
        == sorted(f.name for f in files)
    )
    assert (
        all(f.stat().st_mode & 0o777 == 0o600 for f in files)
        and keys.stat().st_mode & 0o777 == 0o700
    )
    assert len(secret) == 32 and read_env_file(keys / "node.env") == {
        "LUWU_NODE__JOIN_SECRET": secret
    }
    for name in ("join.toml", "monitor.toml"):
        cfg = load_config(str(keys / name), env={})
        assert (
            cfg.transport.join_secret == secret
            and cfg.cluster.job == "dj"
            and cfg.optimizer.name == "sgd"
        )
        assert cfg.cluster.nodes == ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]
    assert secret not in cluster.read_text()
    assert write_job_join_files(keys, cluster)[0] == secret, (
        "a restart keeps the workers' files valid"
    )
    mine = "f" * 32
    monkeypatch.setenv("LUWU_NODE__JOIN_SECRET", mine)
    assert main([str(keys), str(cluster)]) == 0
    assert (
        load_config(str(keys / "join.toml"), env={}).transport.join_secret
        == mine
        == read_env_file(keys / "node.env")["LUWU_NODE__JOIN_SECRET"]
    )
    monkeypatch.delenv("LUWU_NODE__JOIN_SECRET")
    (keys / "join.toml").chmod(
        0o644
    )  # readable by others: the secret may be known, so it is not reused
    assert main([str(keys), str(cluster)]) == 1
    assert main([str(keys)]) == 2


# ----------------------------------------------------------------- the switch tier (aggregators)


@needs_yaml
def test_k8s_aggregator_daemonset_finds_each_hosts_group(tmp_path, capsys):
    """The DaemonSet's selector matches its pods, its groups layer over the nodes' cluster file and
    load, each group's port is the hostPort, and the pod's lookup finds each host's ranks."""
    from luwu.groups import main as group_of

    docs = _k8s_docs()
    ds = docs[("DaemonSet", "luwu-aggregator")]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = ds["spec"]["template"]["spec"]
    (tmp_path / "cluster.toml").write_text(
        docs[("ConfigMap", "luwu-cluster")]["data"]["cluster.toml"]
    )
    (tmp_path / "groups.toml").write_text(docs[("ConfigMap", "luwu-tier")]["data"]["groups.toml"])
    files = [str(tmp_path / "cluster.toml"), str(tmp_path / "groups.toml")]
    cfg = load_config(files, env={})
    assert cfg.cluster.nodes and len(cfg.cluster.groups) == 2
    port = pod["containers"][0]["ports"][0]
    assert port["hostPort"] == port["containerPort"]
    for g in cfg.cluster.groups:
        host, _, gport = g["aggregator"][len("tcp://") :].rpartition(":")
        assert int(gport) == port["hostPort"]
        capsys.readouterr()
        assert group_of([*files, host]) == 0
        assert capsys.readouterr().out.split() == [g["ranks"], gport]
    assert group_of([*files, "no-such-host"]) == 3
    args = " ".join(pod["containers"][0]["args"])
    assert "python -m luwu.groups" in args and "aggregator --config" in args
    assert "/etc/luwu-tier-keys/aggregator$i.env" in args and "LUWU_TRANSPORT__JOIN_SECRET" in args
    assert "/etc/luwu-keys" not in args, "an aggregator never reads the nodes' node.env"
    mounts = {v["name"]: v for v in pod["volumes"]}
    assert mounts["tier"]["configMap"]["name"] == "luwu-tier"
    assert mounts["tier-keys"]["secret"]["secretName"] == "luwu-tier-keys"


PYTHON_SHIM = """#!/bin/sh
# python, except `python -m luwu -v aggregator ...`: its argv and LUWU_* environment to $OUT (JSON).
if [ "$1 $2 $3 $4" = "-m luwu -v aggregator" ]; then
  exec {python} -c 'import json, os, sys
env = {{k: v for k, v in os.environ.items() if k.startswith("LUWU_")}}
json.dump({{"argv": sys.argv[1:], "env": env}}, open(os.environ["OUT"], "w"))' "$@"
fi
exec {python} "$@"
"""


def _run_pod(pod: dict, root: Path, node_name: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The DaemonSet's container command as its pod runs it on ``node_name``, its mounts under
    ``root``: what `luwu aggregator` would have been started with."""
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(PYTHON_SHIM.format(python=sys.executable))
    (bin_dir / "sleep").write_text('#!/bin/sh\necho sleep "$@"\n')  # (sleep infinity)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    container = pod["containers"][0]
    script = container["args"][0].replace("/etc/", f"{root}/etc/")
    out = root / f"{node_name}.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUWU_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", NODE_NAME=node_name, OUT=str(out))
    r = subprocess.run(
        [*container["command"], script], capture_output=True, text=True, timeout=60, env=env
    )
    return r, (json.loads(out.read_text()) if out.exists() else {})


def _mount(pod: dict, docs: dict, secrets: dict[str, Path], root: Path) -> None:
    """The pod's volumes under ``root``: each ConfigMap one the manifests define, each Secret one
    their headers make (``secrets``: its files); every path its command names lies in a mount."""
    made = set()
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        made |= set(re.findall(r"kubectl create secret generic (\S+)", path.read_text()))
    assert made == set(secrets), made
    volumes = {v["name"]: v for v in pod["volumes"]}
    container = pod["containers"][0]
    for m in container["volumeMounts"]:
        v, where = volumes[m["name"]], root / m["mountPath"].lstrip("/")
        if "configMap" in v:
            where.mkdir(parents=True)
            for name, text in docs[("ConfigMap", v["configMap"]["name"])]["data"].items():
                (where / name).write_text(text)
        else:
            shutil.copytree(secrets[v["secret"]["secretName"]], where)
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    for path in re.findall(r"/etc/[\w./$-]+", container["args"][0]):
        assert str(Path(path).parent) in mounted, f"{path}: no mount holds it"


@needs_yaml
@pytest.mark.parametrize("variant", ["curve", "join-secret"])
def test_k8s_aggregator_pods_get_their_own_keys(tmp_path, variant):
    """Every ConfigMap and Secret the tier's pods mount is one the manifests define or their headers
    make, and each file the pod's command reads lies under a mount; run as the pod runs it, the
    command gives the aggregator of each host its own key pair (CURVE: aggregator<i>.env, the key the
    nodes' node.env lists for its ranks and the workers' files name) or the job's join secret."""
    from luwu.groups import aggregator_for, aggregator_key_for
    from luwu.ops.keyset import read_env_file

    docs = _k8s_docs()
    pod = docs[("DaemonSet", "luwu-aggregator")]["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"], (
        "a 0440 Secret is readable by the fsGroup only"
    )
    secrets = _operator_steps(tmp_path, docs, "luwu-aggregators.yaml", variant)
    root = tmp_path / "pod"
    _mount(pod, docs, secrets, root)
    cfg = load_config(
        [str(root / "etc/luwu/cluster.toml"), str(root / "etc/luwu-tier/groups.toml")], env={}
    )
    node_env = read_env_file(secrets["luwu-keys"] / "node.env")
    agg_keys = dict(
        e.split("=", 1)
        for e in node_env.get("LUWU_NODE__CURVE_AGGREGATOR_KEYS", "").split(",")
        if e
    )
    for g in cfg.cluster.groups:
        host, _, port = g["aggregator"][len("tcp://") :].rpartition(":")
        r, started = _run_pod(pod, root, host)
        assert r.returncode == 0 and started, r.stdout + r.stderr
        argv, env = started["argv"], started["env"]
        assert argv[argv.index("--ranks") + 1] == g["ranks"]
        assert argv[argv.index("--node.bind") + 1] == f"tcp://0.0.0.0:{port}"
        assert not [a for a in argv if "secret" in a.lower()], argv
        if variant == "join-secret":
            assert env["LUWU_TRANSPORT__JOIN_SECRET"] == node_env["LUWU_NODE__JOIN_SECRET"]
            assert env["LUWU_NODE__INSECURE_PUBLIC_BIND"] == "true"
            continue
        assert "LUWU_NODE__INSECURE_PUBLIC_BIND" not in env
        own = env["LUWU_NODE__CURVE_PUBLIC_KEY"]
        assert env["LUWU_TRANSPORT__CURVE_PUBLIC_KEY"] == own == agg_keys[g["ranks"]]
        assert env["LUWU_TRANSPORT__CURVE_SERVER_KEY"] == node_env["LUWU_NODE__CURVE_PUBLIC_KEY"]
        assert env["LUWU_NODE__CURVE_SECRET_KEY"] != node_env["LUWU_NODE__CURVE_SECRET_KEY"]
        files = [argv[i + 1] for i, a in enumerate(argv) if a == "--config"]
        resolved = load_config(files, env=env)  # what the aggregator runs with
        assert resolved.node.curve_public_key == own and resolved.transport.curve_server_key
        first = int(g["ranks"].split("-")[0])
        worker = load_config(str(secrets["luwu-worker-keys"] / f"worker{first}.toml"), env={})
        assert aggregator_for(worker, first) == g["aggregator"]
        assert aggregator_key_for(worker, first) == own
    r, started = _run_pod(pod, root, "cpu-host")  # a host with no group runs no aggregator
    assert r.returncode == 0 and not started and "no aggregator here" in r.stdout, r.stdout
    assert "sleep infinity" in r.stdout


def test_sbatch_runs_one_aggregator_per_worker_host_with_its_keys():
    """Task j of the tier's srun step is group j: with CURVE it reads keys/aggregator<j>.env (luwu
    keys --cluster), never node.env; the join secret only when LUWU_INSECURE_PUBLIC_BIND=1. (A whole
    run: tests/integration/test_slurm_tier.py.)"""
    code = "\n".join(_code_lines(DEPLOY / "slurm" / "luwu.sbatch"))
    assert "LUWU_AGGREGATORS" in code and "--overlap" in code and "-m luwu -v aggregator" in code
    assert "--cluster.groups=" in code and '--node-rank="$SLURM_PROCID"' in code
    assert '. "$4/aggregator$SLURM_PROCID.env"' in code
    assert 'if [ "$5" = 1 ]; then . "$4/node.env"' in code
    assert '"$keys_dir" "${LUWU_INSECURE_PUBLIC_BIND:-0}" &' in code
    assert "needs LUWU_INSECURE_PUBLIC_BIND=1" not in code


def test_ssh_aggregators_read_their_own_keys():
    """launch.sh gives aggregator i keys/aggregator<i>.env (luwu keys --cluster), copied as its
    host's aggregator-<i>.env and read by its shell; node.env only when LUWU_INSECURE_PUBLIC_BIND=1.
    (A whole run: tests/integration/test_ssh_tier.py.)"""
    code = "\n".join(_code_lines(DEPLOY / "ssh" / "launch.sh"))
    assert '"$keys_dir/aggregator$i.env" "$target:$dir/aggregator-$i.env"' in code
    assert '. "./aggregator-$i.env"' in code and "check_kept_keys" in code
    body = code[code.index("start_aggregator() {") : code.index("stop_daemon() {")]
    insecure, _, curve = body.partition("else")
    assert "node.env" in insecure and "node.env" not in curve.partition("fi")[0]
    assert "no CURVE keys yet" not in code


def test_systemd_aggregator_unit_reads_only_its_own_keys():
    """luwu-aggregator@.service reads /etc/luwu/aggregator-%i.env alone (keys/aggregator<i>.env,
    its own pair), never the nodes' keys.env. (Run as systemd would: test_systemd_tier.py.)"""
    text = (DEPLOY / "systemd" / "luwu-aggregator@.service").read_text()
    code = "\n".join(_code_lines(DEPLOY / "systemd" / "luwu-aggregator@.service"))
    assert re.findall(r"^EnvironmentFile=(.*)$", code, re.M) == ["/etc/luwu/aggregator-%i.env"]
    assert "keys.env" not in code
    assert "install -m 600 keys/aggregator0.env /etc/luwu/aggregator-0-7.env" in text
    assert "luwu keys --out keys" in text and "--cluster cluster.toml" in text
