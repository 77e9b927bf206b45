"""The documented verl command as Hydra overrides, with its placeholders filled in (used by the README and Ray
tests)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The page whose "## verl (0.9.1)" section holds the command users copy.
MANUAL = REPO / "docs" / "pending" / "gpu.md"


def readme_verl_command() -> list[str]:
    """The arguments of the documented verl launch command (the first bash block of the verl section)."""
    text = MANUAL.read_text()
    section = text[text.index("## verl (0.9.1)") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, f"the verl section of {MANUAL} has no bash block"
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
    """The runtime-environment overrides of the documented measuring runs (the second bash block of the verl
    section), as the shell hands them to Hydra."""
    text = MANUAL.read_text()
    section = text[text.index("## verl (0.9.1)") :]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, f"the verl section of {MANUAL} has no measuring block"
    words = shlex.split(blocks[1].replace("\\\n", " "))
    return [word for word in words if word.startswith("+ray_kwargs.ray_init.runtime_env.env_vars.")]
