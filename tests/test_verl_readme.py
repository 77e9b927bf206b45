"""The verl launch command of docs/verl.md, exactly as written, through verl's own config composition and
`validate_config` (what `python -m verl.trainer.main_ppo` runs before anything else), on parquet files shaped
like verl's GSM8K preprocessing output."""

from __future__ import annotations

from pathlib import Path

from _verl_readme import readme_overrides


def test_the_readme_command_passes_verls_validate_config(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config_path, config_name, overrides = readme_overrides(tmp_path)
    with initialize_config_dir(config_dir=config_path, version_base=None):
        config = compose(config_name=config_name, overrides=overrides)
    validate_config(
        config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
    )
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.DAS_HISTORY_DIR == "/var/lib/das/history"
    assert config.das.bus.startswith("kafka://")
    assert Path(config.actor_rollout_ref.rollout.router_config_path).is_file()


def test_the_readme_router_file_loads_through_verls_plugin_loader(tmp_path) -> None:
    from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class

    from workers.verl.router import ProblemAffinityLoadBalancer

    _, _, overrides = readme_overrides(tmp_path)
    (path,) = [
        o.split("=", 1)[1] for o in overrides if o.startswith("actor_rollout_ref.rollout.router_config_path=")
    ]
    loaded = _load_router_yaml(path)
    assert _resolve_router_class(loaded["router_class"]) is ProblemAffinityLoadBalancer
