import os

# ALFWorld's package sets $ALFWORLD_DATA to ~/.cache/alfworld when it is imported and finds it unset: what
# the user set (or not) is read here, before any module of this package imports alfworld
# (env_servers.alfworld_env.default_data_dir tells the two apart).
ALFWORLD_DATA_AT_START = os.environ.get("ALFWORLD_DATA")
