#!/usr/bin/env bash
# Starts a training job on a Ray cluster: `gigpo train CONFIG [overrides...]` with the trajectory stream
# pointed at the cluster's Redis. Used as the job entrypoint on the head node, by `ray job submit` on
# a cluster from deploy/ray-cluster.yaml and by deploy/kuberay/rayjob.yaml.
#
#   bash deploy/entrypoint.sh configs/cluster_alfworld_1.5b.yaml [section.field=value ...]
#
# The Redis URL is built here, on the head, from the environment; its password never appears on a command
# line (not even this script's `gigpo train`: `ps` shows those), in a manifest or in a job submission
# (KubeRay passes the entrypoint through a shell on the submitter pod):
#   GIGPO_REDIS_HOST           default: this node's IP as Ray finds it (the VM cluster runs Redis on the head)
#   GIGPO_REDIS_PORT           default: 6380 (6379 is Ray's GCS port on the head)
#   GIGPO_REDIS_PASSWORD       read by `gigpo train` from its environment (e.g. a Kubernetes Secret as an env var)
#   GIGPO_REDIS_PASSWORD_FILE  else: a file holding it (default ~/.gigpo/redis_password; a Secret mounted as a
#                              file), passed on as stream.redis_password_file (the path, not the password)
#   GIGPO_REDIS_ADMIN_PASSWORD the Redis's admin user's password (KubeRay: the Secret's admin-password), or
#   GIGPO_REDIS_ADMIN_FILE     a file holding it (default ~/gigpo-redis/admin-password, `gigpo redis`'s): with
#                              either (the env first, then a readable file; before GIGPO_REDIS_PASSWORD), the
#                              driver is given the admin user's URL and hands the run's actors a user of the run
#                              alone (common/stream/redis_server.py add_run_user): another run's rollout nodes
#                              cannot read or delete this run's groups
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:?usage: entrypoint.sh CONFIG [overrides...]}"
shift
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
# The address Ray takes for this node when `ray start` is given none (the route to the outside), not the first
# of `hostname -I`, which on a multi-homed host (a Docker bridge, a second NIC) may be one the workers cannot reach.
host="${GIGPO_REDIS_HOST:-$("$py" -c 'import ray.util; print(ray.util.get_node_ip_address())')}"
port="${GIGPO_REDIS_PORT:-6380}"
password_args=()
user=""
admin_file="${GIGPO_REDIS_ADMIN_FILE:-$HOME/gigpo-redis/admin-password}"
if [ -n "${GIGPO_REDIS_ADMIN_PASSWORD:-}" ]; then
  user="gigpo-admin@"
  export GIGPO_REDIS_PASSWORD="$GIGPO_REDIS_ADMIN_PASSWORD"     # read by `gigpo train`, never on a command line
elif [ -z "${GIGPO_REDIS_PASSWORD:-}" ] && [ -r "$admin_file" ]; then
  user="gigpo-admin@"
  password_args=("stream.redis_password_file=$admin_file")
elif [ -z "${GIGPO_REDIS_PASSWORD:-}" ]; then
  password_file="${GIGPO_REDIS_PASSWORD_FILE:-$HOME/.gigpo/redis_password}"
  [ -r "$password_file" ] || { echo "entrypoint.sh: no GIGPO_REDIS_PASSWORD and no $password_file" >&2; exit 2; }
  password_args=("stream.redis_password_file=$password_file")
fi
# This job's command as submitted: what `gigpo train` names as the one that resumes it after a lost part
# (with run.resume=true added), rather than its own command line with the Redis arguments added here.
GIGPO_RESUME_COMMAND="bash $(realpath "$0") $(printf '%q ' "$config" "$@")"
export GIGPO_RESUME_COMMAND
# RAY_ADDRESS=auto: join the cluster this node belongs to instead of starting a local Ray.
export RAY_ADDRESS="${RAY_ADDRESS:-auto}"
exec "$py" -m deploy.cli train "$config" "stream.redis_url=redis://${user}${host}:${port}/0" \
  ${password_args[@]+"${password_args[@]}"} "$@"
