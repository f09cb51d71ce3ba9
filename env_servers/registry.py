"""Which TextEnv an EnvConfig names. Engines are imported lazily: a WebShop run never imports TextWorld."""
from __future__ import annotations

from common.config import EnvConfig, choices
from env_servers.base import TextEnv

ENV_NAMES = choices(EnvConfig, "name")
_MODULES = {"alfworld": "env_servers.alfworld_env", "webshop": "env_servers.webshop.env"}


def make_env(env_cfg: EnvConfig, seed: int = 0) -> TextEnv:
    """A fresh single-instance environment for `env_cfg.name` ("alfworld" or "webshop")."""
    if env_cfg.name == "alfworld":
        from env_servers.alfworld_env import ALFWorldEnv
        return ALFWorldEnv(source=env_cfg.source, engine=env_cfg.engine, generator=env_cfg.generator,
                           num_generated_games=env_cfg.num_generated_games, seed=seed)
    if env_cfg.name == "webshop":
        try:
            from env_servers.webshop.env import WebShopEnv
        except ImportError as exc:
            raise ImportError(f"env.name=webshop needs env_servers.webshop ({exc})") from exc
        from env_servers.webshop.data import catalog_dir
        return WebShopEnv(data_dir=catalog_dir(env_cfg.source), seed=seed)
    raise ValueError(f"unknown env.name {env_cfg.name!r}; choose one of {ENV_NAMES}")


def data_env(env_cfg: EnvConfig) -> dict[str, str]:
    """The environment variables naming the data an env of `env_cfg` reads ({} for none), as absolute paths
    resolved here: the driver gives them to every actor, whose working directory is wherever Ray starts it."""
    if env_cfg.source != "data":
        return {}
    if env_cfg.name == "webshop":
        from env_servers.webshop.data import default_data_dir
        return {"WEBSHOP_DATA": default_data_dir()}
    from env_servers.alfworld_env import default_data_dir
    return {"ALFWORLD_DATA": default_data_dir()}


def preload_modules(env_cfg: EnvConfig) -> list[str]:
    """Modules worth importing once in a fork server before env worker processes start (slow imports)."""
    return [_MODULES[env_cfg.name]] if env_cfg.name in _MODULES else []
