"""CUDA graph capture sizes that cover a drafting engine's decode steps (`rollout.cudagraph_capture_sizes`).

A decode step of a speculative engine schedules, per running request, its new token plus its drafts: up to
`max_num_seqs` x (1 + K) tokens. vLLM 0.24 (verl 0.9.1's pin) captures graphs only up to
min(max_num_seqs x (1 + K) x 2, 512, max_num_batched_tokens) tokens when no sizes are given
(`VllmConfig._set_cudagraph_sizes`), and with full decode graphs (verl's default `FULL_AND_PIECEWISE`) rounds
every size up to a multiple of 1 + K and drops those above the cap (`adjust_cudagraph_sizes_for_spec_decode`):
504 tokens at K = 8. A step over the largest size runs without any graph (`CudagraphDispatcher.dispatch`:
`num_tokens > max_cudagraph_capture_size` gives NONE), so under verl's defaults a full batch of 256 requests that
drafts more than 248 tokens in all runs eagerly.

`capture_sizes` keeps vLLM's own sizes up to that cap (fine steps where the batch is small and memory-bound) and
adds one size every 8 requests' worth of full drafts (8 x (1 + K) tokens) up to max_num_seqs x (1 + K); every
size is a multiple of 1 + K, so vLLM's rounding leaves the list as it is. Print the override for other settings:

    python -m workers.verl.graphs --max-num-seqs 256 --k 8
"""

from __future__ import annotations

import argparse

from workers.errors import InvalidInput

# vLLM's default capture ceiling in tokens (vLLM 0.24 `_set_cudagraph_sizes`; Blackwell data-center parts get 1024
# in later versions).
DEFAULT_CEILING = 512
# verl 0.9.1's rollout.max_num_batched_tokens default (verl/trainer/config/rollout/rollout.yaml).
MAX_NUM_BATCHED_TOKENS = 8192
# Requests per step between the sizes added above the ceiling.
ROWS_STRIDE = 8


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def capture_sizes(
    max_num_seqs: int, k: int, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
) -> list[int]:
    """Capture sizes, in scheduled tokens, covering every decode step of `max_num_seqs` requests with K drafts.

    Raises:
        ValueError: max_num_seqs below 1 or k below 0.
    """
    if max_num_seqs < 1 or k < 0:
        raise InvalidInput(f"max_num_seqs >= 1 and k >= 0 are required, got {max_num_seqs} and {k}")
    query = 1 + k
    ceiling = min(max_num_seqs * query * 2, DEFAULT_CEILING, max_num_batched_tokens)
    # vLLM's default grid: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256, each rounded up to a
    # multiple of 1 + K within the ceiling.
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, ceiling + 1, 16)]
    sizes = {_round_up(size, query) for size in grid if _round_up(size, query) <= ceiling}
    top = min(max_num_seqs * query, max_num_batched_tokens)
    sizes |= {
        rows * query for rows in range(ROWS_STRIDE, max_num_seqs + 1, ROWS_STRIDE) if rows * query <= top
    }
    sizes.add(top if top % query == 0 else _round_up(top, query) - query)
    return sorted(s for s in sizes if s >= 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="actor_rollout_ref.rollout.max_num_seqs"
    )
    parser.add_argument("--k", type=int, default=8, help="speculative_config.num_speculative_tokens")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=MAX_NUM_BATCHED_TOKENS,
        help="actor_rollout_ref.rollout.max_num_batched_tokens",
    )
    args = parser.parse_args(argv)
    sizes = capture_sizes(args.max_num_seqs, args.k, args.max_num_batched_tokens)
    print(f"actor_rollout_ref.rollout.cudagraph_capture_sizes=[{','.join(map(str, sizes))}]")


if __name__ == "__main__":
    main()
