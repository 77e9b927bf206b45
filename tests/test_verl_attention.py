"""The example trains without flash-attn: the attention it names builds and computes verl's packed inputs right.

verl 0.9.1's model config defaults to `attn_implementation="flash_attention_2"` (verl/workers/config/model.py,
`override_config.get("attn_implementation", "flash_attention_2")`), and flash-attn comes only with verl's `fsdp`
extras, as an sdist that needs nvcc and CUDA_HOME to build, so `pip install ".[verl]"` gives a trainer that cannot
build its model. examples/verl/das_grpo.yaml names `sdpa` (PyTorch's own attention). These tests build the
model the way verl's FSDP engine does (`_build_module`: verl's HFModelConfig from the composed example,
`get_hf_auto_model_class(...).from_pretrained(config=hf_config)`, then `apply_monkey_patch` with the example's
`use_remove_padding`), here without flash-attn installed, and check that the packed, padding-free batches verl
feeds it (sequences concatenated in one row, positions restarting at each sequence, no attention mask) give each
sequence the logits it has alone.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = REPO / "examples" / "verl"


def _model_config() -> Any:
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from workers.generator.model import require_model

    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        config = compose(
            config_name="das_grpo", overrides=[f"actor_rollout_ref.model.path={require_model()}"]
        )
    return omega_conf_to_dataclass(config.actor_rollout_ref.model)


def test_the_example_builds_verls_training_model_without_flash_attn_and_packs_sequences_apart() -> None:
    import torch
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.model import get_hf_auto_model_class

    assert importlib.util.find_spec("flash_attn") is None, "this test is about an install without flash-attn"
    model_config = _model_config()
    assert model_config.use_remove_padding  # verl's default: packed batches
    # As verl's FSDP engine builds it (training runs in float32 there).
    module = get_hf_auto_model_class(hf_config=model_config.hf_config).from_pretrained(
        pretrained_model_name_or_path=model_config.local_path,
        torch_dtype=torch.float32,
        config=model_config.hf_config,
        trust_remote_code=model_config.trust_remote_code,
    )
    apply_monkey_patch(model=module, use_remove_padding=model_config.use_remove_padding, ulysses_sp_size=1)
    module.eval()
    tokenizer = model_config.tokenizer
    sequences = [
        tokenizer("Problem: what is 2 + 2? Answer: 4.")["input_ids"],
        tokenizer("A longer second sequence, so that the two differ in length and content.")["input_ids"],
    ]
    with torch.no_grad():
        alone = [module(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in sequences]
        # verl's remove-padding layout: one row, positions restarting per sequence, no attention mask.
        packed_ids = torch.tensor([sequences[0] + sequences[1]])
        restart = torch.tensor([list(range(len(sequences[0]))) + list(range(len(sequences[1])))])
        packed = module(
            input_ids=packed_ids, position_ids=restart, attention_mask=None, use_cache=False
        ).logits[0]
        # Positive control: the same row read as one sequence lets the second attend to the first.
        joined = module(
            input_ids=packed_ids, position_ids=torch.arange(packed_ids.shape[1])[None], use_cache=False
        ).logits[0]
    cut = len(sequences[0])
    torch.testing.assert_close(packed[:cut], alone[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(packed[cut:], alone[1], atol=1e-4, rtol=1e-4)
    assert (joined[cut:] - alone[1]).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["flash_attention_2"])
def test_a_flash_attention_override_is_the_one_line_that_needs_flash_attn(attention: str) -> None:
    """docs/verl.md: with flash-attn installed (verl's image), override the example's attention back."""
    from hydra import compose, initialize_config_dir

    from workers.generator.model import require_model

    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        config = compose(
            config_name="das_grpo",
            overrides=[
                f"actor_rollout_ref.model.path={require_model()}",
                f"actor_rollout_ref.model.override_config.attn_implementation={attention}",
            ],
        )
    assert config.actor_rollout_ref.model.override_config.attn_implementation == attention
