"""Every decode step of the example's drafting engine runs in a CUDA graph, by vLLM's own rule.

A speculative decode step schedules each running request's new token plus its drafts: up to max_num_seqs x (1 + K)
tokens. verl 0.9.1 hands `rollout.cudagraph_capture_sizes` to vLLM's `compilation_config` and sets
`cudagraph_mode` to FULL_AND_PIECEWISE unless given (verl/workers/rollout/vllm_rollout/vllm_async_server.py,
`launch_server`). These tests run vLLM's own capture-size rule (`VllmConfig._set_cudagraph_sizes`,
`CompilationConfig.resolve_cudagraph_mode_and_sizes`) and `CudagraphDispatcher` on the engine config built from
the composed example, as a GPU would run them: the CPU platform turns graphs off, so the test switches the
config to what vLLM's CUDA platform sets (compiled model, attention split out of the graph, an attention
backend with uniform-batch graph support, as FlashAttention on Hopper). vLLM 0.32's rule for given sizes, its
rounding to multiples of 1 + K and its dispatcher are the same as vLLM 0.24's; its default sizes differ, but
both stop at 504 tokens here (docs/verl.md, "CUDA graphs").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = REPO / "examples" / "verl"


def _compose() -> Any:
    from hydra import compose, initialize_config_dir

    from workers.generator.model import require_model

    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        return compose(config_name="das_grpo", overrides=[f"actor_rollout_ref.model.path={require_model()}"])


def _dispatcher(rollout: Any, sizes: list[int] | None) -> tuple[Any, Any]:
    """vLLM's engine config for the example's rollout settings as a CUDA platform resolves it, and its
    dispatcher."""
    from omegaconf import OmegaConf
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from workers.generator.model import require_model

    speculative = OmegaConf.to_container(rollout.engine_kwargs.vllm.speculative_config, resolve=True)
    config = EngineArgs(
        model=str(require_model()),
        max_model_len=2048,
        max_num_seqs=rollout.max_num_seqs,
        max_num_batched_tokens=rollout.max_num_batched_tokens,
        speculative_config=speculative,
    ).create_engine_config()
    compilation = config.compilation_config
    # What vLLM's CUDA platform and verl's launch_server set, where the CPU platform turns graphs off.
    config.model_config.enforce_eager = rollout.enforce_eager
    compilation.mode = CompilationMode.VLLM_COMPILE
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    compilation.splitting_ops = None
    compilation.set_splitting_ops_for_v1(all2all_backend="")
    compilation.cudagraph_capture_sizes = sizes
    compilation.max_cudagraph_capture_size = None
    config._set_cudagraph_sizes()
    query = 1 + speculative["num_speculative_tokens"]
    mode = compilation.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.UNIFORM_BATCH, "FLASH_ATTN", query)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, query)
    return config, dispatcher


@pytest.mark.vllm
def test_the_examples_capture_sizes_cover_every_decode_step_of_a_full_drafting_batch() -> None:
    from verl.utils.config import omega_conf_to_dataclass
    from vllm.config import CUDAGraphMode

    from workers.verl.graphs import capture_sizes

    rollout = _compose().actor_rollout_ref.rollout
    k = rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens
    widest = rollout.max_num_seqs * (1 + k)
    assert (rollout.max_num_seqs, k, widest) == (256, 8, 2304)
    # verl's typed rollout config keeps the list it hands to vLLM's compilation_config.
    sizes = omega_conf_to_dataclass(rollout).cudagraph_capture_sizes
    assert sizes == capture_sizes(rollout.max_num_seqs, k, rollout.max_num_batched_tokens)
    config, dispatcher = _dispatcher(rollout, list(sizes))
    # vLLM keeps every size: all are multiples of 1 + K within max_num_batched_tokens.
    assert config.compilation_config.cudagraph_capture_sizes == list(sizes)
    uncovered = [n for n in range(1, widest + 1) if dispatcher.dispatch(n)[0] == CUDAGraphMode.NONE]
    assert not uncovered, f"{len(uncovered)} step sizes run without a graph, from {uncovered[0]} tokens"
    # A step in which every request drafts K runs in a full graph.
    assert dispatcher.dispatch(widest, uniform_decode=True)[0] == CUDAGraphMode.FULL

    # verl's defaults (no sizes): vLLM's own list, the same as the example's below its 504-token ceiling, and
    # every step above it eager.
    default, eager = _dispatcher(rollout, None)
    assert default.compilation_config.cudagraph_capture_sizes == [s for s in sizes if s <= 504]
    assert eager.dispatch(504)[0] != CUDAGraphMode.NONE
    assert all(eager.dispatch(n)[0] == CUDAGraphMode.NONE for n in (505, 512, 1024, widest))


def test_capture_sizes_for_other_settings() -> None:
    from workers.verl.graphs import capture_sizes

    # vLLM's own sizes reach twice the widest decode step (prefill chunks share steps): the list keeps them.
    sizes = capture_sizes(64, 4)
    assert 64 * 5 in sizes and sizes[-1] == 500 and all(s % 5 == 0 for s in sizes)
    # Cut at max_num_batched_tokens, to the last multiple of 1 + K within it.
    assert capture_sizes(1024, 8, max_num_batched_tokens=8192)[-1] == 8190
    with pytest.raises(ValueError):
        capture_sizes(0, 8)
