"""The verl launch command of the manual (docs/verl.md) as Hydra overrides, with its placeholders filled in (used
by the launch-command and Ray tests)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_verl_command() -> list[str]:
    """The arguments of the verl launch command (the first bash block of docs/verl.md's "Launch" section)."""
    text = (REPO / "docs" / "verl.md").read_text()
    section = text[text.index("## Launch") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "docs/verl.md's Launch section has no bash block"
    return shlex.split(block.group(1).replace("\\\n", " "))


def readme_overrides(tmp_path: Path) -> tuple[str, str, list[str]]:
    import datasets

    from workers.generator.model import require_model

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


def measuring_overrides() -> list[str]:
    """The runtime-environment overrides of the documented measuring runs (the bash block of docs/verl.md's
    "Trade-offs to measure on a GPU" section), as the shell hands them to Hydra."""
    text = (REPO / "docs" / "verl.md").read_text()
    section = text[text.index("## Trade-offs to measure on a GPU") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "docs/verl.md's trade-offs section has no measuring block"
    words = shlex.split(block.group(1).replace("\\\n", " "))
    return [word for word in words if word.startswith("+ray_kwargs.ray_init.runtime_env.env_vars.")]
