"""The README's verl command, exactly as written, through verl's own config composition and `validate_config`
(what `python -m verl.trainer.main_ppo` runs before anything else), on parquet files shaped like verl's GSM8K
preprocessing output."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_verl_command() -> list[str]:
    """The arguments of the README's verl launch command (the first bash block of its verl section)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## verl (0.9.1)") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's verl section has no bash block"
    return shlex.split(block.group(1).replace("\\\n", " "))


def _overrides(tmp_path: Path) -> tuple[str, str, list[str]]:
    import datasets

    from workers.model import require_model

    command = readme_verl_command()
    assert command[:3] == ["python", "-m", "verl.trainer.main_ppo"]
    config_path = command[command.index("--config-path") + 1].replace("$PWD", str(REPO))
    config_name = command[command.index("--config-name") + 1]
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(4)
    ]
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    placeholders = {
        "<model>": str(require_model()),
        "<train.parquet>": str(parquet),
        "<val.parquet>": str(parquet),
    }
    overrides = []
    for arg in command[command.index("--config-name") + 2 :]:
        for placeholder, value in placeholders.items():
            arg = arg.replace(placeholder, value)
        overrides.append(arg.replace("$PWD", str(REPO)))
    return config_path, config_name, overrides


def test_the_readme_command_passes_verls_validate_config(tmp_path) -> None:
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config_path, config_name, overrides = _overrides(tmp_path)
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

    _, _, overrides = _overrides(tmp_path)
    (path,) = [
        o.split("=", 1)[1] for o in overrides if o.startswith("actor_rollout_ref.rollout.router_config_path=")
    ]
    loaded = _load_router_yaml(path)
    assert _resolve_router_class(loaded["router_class"]) is ProblemAffinityLoadBalancer
