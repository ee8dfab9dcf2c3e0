"""The cluster files (image, `ray up` config, KubeRay job, docs/cluster.md) agree with the code.

Every `millpond launch` command they contain must parse with the real command line and
name a config that loads with its `--set` overrides applied. Versions that must match
across them must match. Nothing here starts Ray or Docker.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from millpond.deploy.launch_cli import build_parser
from millpond.deploy.launch_config import LaunchConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
RAY_CLUSTER = ROOT / "deploy" / "cluster" / "ray-cluster.yaml"
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
CLUSTER_DOC = ROOT / "docs" / "cluster.md"

# Where a command's relative config path is resolved, by the path it starts with: the
# sources that `ray up` copies to the nodes. Anything else is relative to the repository
# root, or to `--working-dir` when the command is a `ray job submit`. The image's working
# directory mirrors the repository's deploy/configs (checked below).
REMOTE_PREFIXES = {"~/millpond-src/": ROOT}
SHELL_SEPARATORS = {"&&", "||", ";", "|"}


# -- reading the files ------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def rayjob() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def ray_cluster() -> dict:
    return yaml.safe_load(RAY_CLUSTER.read_text())


def doc_code_lines() -> list[str]:
    """Lines of docs/cluster.md's fenced code blocks, continuation lines joined."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", CLUSTER_DOC.read_text(), re.M | re.S)
    return [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]


def comment_lines(path: Path) -> list[str]:
    """The text of a file's `#` comment lines (where usage examples live)."""
    lines = path.read_text().splitlines()
    return [line.strip()[1:] for line in lines if line.strip().startswith("#")]


def launch_commands(line: str) -> list[tuple[list[str], Path]]:
    """Every `millpond launch` in a shell line: (its arguments, where its config resolves)."""
    if "millpond launch" not in line:
        return []
    tokens = shlex.split(line, comments=True)
    found = []
    for i, token in enumerate(tokens):
        if token.startswith("millpond launch "):  # quoted, as in `ray exec CONFIG '...'`
            found += launch_commands(token)
        elif token == "millpond" and tokens[i + 1 : i + 2] == ["launch"]:
            args = []
            for arg in tokens[i + 2 :]:
                if arg in SHELL_SEPARATORS:
                    break
                args.append(arg)
            base = ROOT
            if "--working-dir" in tokens[:i]:
                base = ROOT / tokens[tokens.index("--working-dir") + 1]
            found.append((args, base))
    return found


def docker_cmd() -> list[str]:
    (cmd,) = [args for word, args in dockerfile_instructions() if word == "CMD"]
    return json.loads(cmd)  # exec form, or this fails


def all_launch_commands() -> list[tuple[str, str, list[str], Path]]:
    """(where, the line, the arguments, where the config resolves) of every launch command."""
    cmd = docker_cmd()
    commands = [("Dockerfile CMD", shlex.join(cmd), cmd[2:], ROOT)]
    sources = {
        "RayJob entrypoint": [rayjob_entrypoint()],
        "docs/cluster.md": doc_code_lines(),
        "ray-cluster.yaml comments": comment_lines(RAY_CLUSTER),
        "rayjob.yaml comments": comment_lines(RAYJOB),
        "Dockerfile comments": comment_lines(DOCKERFILE),
    }
    for where, lines in sources.items():
        for line in lines:
            commands += [(where, line, a, b) for a, b in launch_commands(line)]
    # A resumed job's config is its run directory's: checked by test_resume_commands_parse.
    return [c for c in commands if "--resume" not in c[2]]


def test_resume_commands_parse():
    resumes = [a for line in doc_code_lines() for a, _ in launch_commands(line) if "--resume" in a]
    assert resumes, "docs/cluster.md shows no launch --resume"
    for args in resumes:
        parsed = build_parser().parse_args(args)
        assert parsed.resume and parsed.config is None, args


def rayjob_entrypoint() -> str:
    return rayjob()["spec"]["entrypoint"]


def parse_and_load(args: list[str], base: Path) -> tuple[object, LaunchConfig]:
    """What `millpond launch ARGS` does before starting anything (see launch.run)."""
    parsed = build_parser().parse_args(args)
    overrides = list(parsed.overrides)
    if parsed.address:
        overrides.append(f"ray.address={parsed.address}")
    path = parsed.config
    for prefix, root in REMOTE_PREFIXES.items():
        if path.startswith(prefix):
            path, base = path[len(prefix) :], root
    assert not Path(path).is_absolute(), f"{parsed.config}: no such file in the repository"
    config_file = base / path
    assert config_file.is_file(), f"{parsed.config} resolves to {config_file}, which is missing"
    return parsed, load_config(config_file, overrides)


# -- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "deploy").rglob("*.yaml")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_yaml_file_parses(path):
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and doc


def test_the_files_contain_the_commands_the_docs_promise():
    commands = all_launch_commands()
    wheres = [where for where, _, _, _ in commands]
    assert {"Dockerfile CMD", "RayJob entrypoint", "ray-cluster.yaml comments"} <= set(wheres)
    assert wheres.count("docs/cluster.md") >= 4


@pytest.mark.parametrize(
    "where, line, args, base",
    all_launch_commands(),
    ids=[f"{where}: {line[:60]}" for where, line, _, _ in all_launch_commands()],
)
def test_every_launch_command_parses_and_its_config_loads(where, line, args, base):
    # argparse exits (SystemExit) on an unknown flag or a missing argument
    try:
        _, config = parse_and_load(args, base)
    except SystemExit:
        pytest.fail(f"{where}: `millpond launch {shlex.join(args)}` does not parse")
    assert isinstance(config, LaunchConfig)


def test_cluster_commands_join_the_cluster_and_write_to_an_absolute_run_dir():
    for where, line, args, base in all_launch_commands():
        if where == "Dockerfile CMD" or line.startswith("docker run"):
            continue  # the image on its own: a local Ray instance
        parsed, config = parse_and_load(args, base)
        assert parsed.address == "auto", f"{where}: {line} lacks --address auto"
        assert Path(config.run.dir).is_absolute(), f"{where}: {line}: relative run.dir"


def test_rayjob_entrypoint_is_the_documented_job():
    args, base = launch_commands(rayjob_entrypoint())[0]
    parsed, config = parse_and_load(args, base)
    assert parsed.config == "deploy/configs/cartpole-ppo.yaml"
    assert config.ray.address == "auto" and config.run.dir == "/tmp/runs"
    assert config.learner.algorithm == "ppo"


def test_dockerfile_installs_torch_before_the_project_and_drops_root():
    instructions = dockerfile_instructions()
    runs = [args for word, args in instructions if word == "RUN"]
    torch = [i for i, args in enumerate(runs) if re.search(r"pip install .*\btorch\b", args)]
    project = [i for i, args in enumerate(runs) if re.search(r"pip install (/src|\.)(\s|$)", args)]
    assert torch and project, "expected a torch install and a project install"
    assert torch[0] < project[0]
    assert "download.pytorch.org/whl/cpu" in runs[torch[0]]
    users = [args for word, args in instructions if word == "USER"]
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    words = [w for w, _ in instructions]
    last_user = max(i for i, w in enumerate(words) if w == "USER")
    assert last_user < words.index("CMD")
    assert last_user > max(
        i for i, w in enumerate(words) if w == "RUN"
    )  # nothing after runs as root


def test_dockerfile_copies_what_the_install_and_the_cmd_need():
    instructions = dockerfile_instructions()
    copies = [args.split() for word, args in instructions if word == "COPY"]
    sources = {src for args in copies for src in args[:-1]}
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    assert {"pyproject.toml", "README.md"} | set(package_dirs()) <= sources
    # the CMD's relative config path exists under WORKDIR
    words = [w for w, _ in instructions]
    workdir_at = max(i for i, w in enumerate(words) if w == "WORKDIR")
    after = [args.split() for w, args in instructions[workdir_at:] if w == "COPY"]
    assert ["deploy/configs", "deploy/configs"] in after


def test_ray_cluster_yaml_is_an_on_premise_cluster():
    config = ray_cluster()
    provider = config["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] and provider["worker_ips"]  # ray up aborts without both
    for command in config["head_start_ray_commands"]:
        assert "--dashboard-host" not in command  # the job API stays on loopback
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])
    # the mounts are local paths relative to the repository root, and cover the install
    sources = set(config["file_mounts"].values())
    for src in sources:
        assert (ROOT / src).exists(), f"file_mounts source {src} is not in the repository"
    assert {"pyproject.toml", "README.md"} | set(package_dirs()) <= sources
    setup = config["setup_commands"]
    torch = [i for i, c in enumerate(setup) if re.search(r"pip install .*\btorch\b", c)]
    project = [i for i, c in enumerate(setup) if "pip install" in c and "millpond-src" in c]
    assert torch and project and torch[0] < project[0]


def test_ray_cluster_yaml_validates_against_rays_schema():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    spec = importlib.util.find_spec("ray")  # without importing Ray
    schema_file = Path(spec.origin).parent / "autoscaler" / "ray-schema.json" if spec else None
    if schema_file is None or not schema_file.is_file():
        pytest.skip("the installed Ray does not ship autoscaler/ray-schema.json")
    schema = json.loads(schema_file.read_text())
    jsonschema.validate(ray_cluster(), schema)
    broken = {**ray_cluster(), "head_start_ray_comands": []}  # the schema does catch typos
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_versions_agree_across_image_cluster_and_rayjob():
    args = dict(a.split("=", 1) for w, a in dockerfile_instructions() if w == "ARG" and "=" in a)
    setup = " ".join(ray_cluster()["setup_commands"])
    (ray_pin,) = re.findall(r"ray\[default\]==([\w.]+)", setup)
    (torch_pin,) = re.findall(r"torch==([\w.]+)", setup)
    assert args["RAY_VERSION"] == ray_pin == rayjob()["spec"]["rayClusterSpec"]["rayVersion"]
    assert args["TORCH_VERSION"] == torch_pin
    specifiers = pytest.importorskip("packaging.specifiers")
    requirements = project_requirements()
    for name, pin in (("ray", ray_pin), ("torch", torch_pin)):
        assert pin in specifiers.SpecifierSet(requirements[name]), f"{name}=={pin}"


def test_rayjob_shape():
    job = rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(groups) >= 2
    for group in groups:
        assert isinstance(group["rayStartParams"], dict)  # required by the CRD
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["image"]
            resources = container["resources"]
            assert resources["requests"] and resources["limits"]
    # the workers hold what cartpole-ppo.yaml asks Ray for
    args, base = launch_commands(spec["entrypoint"])[0]
    _, config = parse_and_load(args, base)
    needed = (
        config.replay.shards * config.replay.num_cpus
        + config.actors.num_actors * config.actors.num_cpus
    )
    available = sum(
        g["replicas"] * float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        for g in cluster["workerGroupSpecs"]
    )
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert needed <= available


def test_every_flag_the_doc_names_exists():
    text = CLUSTER_DOC.read_text()
    launch_flags = {a.option_strings[0] for a in build_parser()._actions if a.option_strings}
    for flag in set(re.findall(r"millpond launch [^`\n]*", text)):
        for option in re.findall(r"(?<!\S)(--[a-z-]+)", flag):
            assert option in launch_flags, f"millpond launch has no {option}"
    from millpond.service.server import build_parser as serve_parser

    serve_flags = {a.option_strings[0] for a in serve_parser()._actions if a.option_strings}
    for flag in set(re.findall(r"millpond serve [^`\n]*", text)):
        for option in re.findall(r"(?<!\S)(--[a-z-]+)", flag):
            assert option in serve_flags, f"millpond serve has no {option}"


# -- pyproject ----------------------------------------------------------------------------------
def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_dirs() -> list[str]:
    dirs = pyproject()["tool"]["setuptools"]["package-dir"].values()
    return sorted(set(dirs))


def project_requirements() -> dict[str, str]:
    out = {}
    for requirement in pyproject()["project"]["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", requirement)
        out[match[1].lower()] = match[2].split(";")[0].strip()
    return out


def test_rayjob_learner_gpu_group_offers_what_its_command_asks_for():
    """The learner-gpu group's GPU and custom resource are what the command its comment
    shows asks each learner for, and only the learners ask for that resource."""
    cluster = rayjob()["spec"]["rayClusterSpec"]
    (group,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "learner-gpu"]
    container = group["template"]["spec"]["containers"][0]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(container["resources"]["requests"]["nvidia.com/gpu"]) == gpus >= 1
    params = group["rayStartParams"]
    assert int(params["num-gpus"]) == gpus
    offered = json.loads(json.loads(params["resources"]))  # KubeRay's quoted JSON string
    gpu_commands = [
        args
        for line in comment_lines(RAYJOB)
        for args, _ in launch_commands(line)
        if any("learner.num_gpus" in a for a in args)
    ]
    assert gpu_commands, "rayjob.yaml shows no command for the learner-gpu group"
    for args in gpu_commands:
        _, config = parse_and_load(args, ROOT)
        assert config.learner.num_gpus <= gpus and config.learner.device == "cuda"
        assert config.learner.resources, "the learners must ask for the group's resource"
        for name, amount in config.learner.resources.items():
            assert amount <= offered.get(name, 0), f"learner-gpu offers no {name}: {amount}"
            assert name not in config.actors.resources and name not in config.replay.resources
    # the CPU groups do not offer it, so nothing else lands on the GPU node by that resource
    for other in cluster["workerGroupSpecs"]:
        if other is not group:
            assert "resources" not in other["rayStartParams"]


def test_ray_cluster_yaml_gives_gpu_workers_the_learner_resource():
    """`ray up`'s workers with a GPU offer learner_node, the resource the documented GPU
    command places its learners by; the head and the other workers offer none."""
    config = ray_cluster()
    (start,) = [c for c in config["worker_start_ray_commands"] if "ray start --address" in c]
    conditional = re.search(r"\$\(test -e /dev/nvidia0 && echo '--resources=(\{.*?\})'\)", start)
    assert conditional, start
    offered = json.loads(conditional.group(1))
    assert not any("--resources" in c for c in config["head_start_ray_commands"])
    gpu_commands = [
        (args, base)
        for line in doc_code_lines()
        for args, base in launch_commands(line)
        if "~/millpond-src/" in " ".join(args) and any("learner.num_gpus" in a for a in args)
    ]
    assert gpu_commands, "docs/cluster.md shows no ray up command for the learner nodes"
    for args, base in gpu_commands:
        _, launch = parse_and_load(args, base)
        assert launch.learner.num_gpus >= 1 and launch.learner.resources
        for name, amount in launch.learner.resources.items():
            assert amount <= offered.get(name, 0), f"the GPU workers offer no {name}"


def test_the_shipped_tables_file_loads_every_sampler_kind():
    from millpond.service.server import load_tables

    tables = load_tables(ROOT / "deploy" / "configs" / "tables.yaml")
    assert {t.sampler for t in tables} == {
        "uniform",
        "prioritized",
        "queue",
        "slices",
        "prioritized_slices",
    }
