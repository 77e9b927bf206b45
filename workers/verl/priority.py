"""One priority scale for every agent loop worker: the tail first, from lengths the router actor keeps.

verl hands each rollout row's `priority` to vLLM (`generate(..., priority=...)`), which admits lower values first
under `rollout.scheduling_policy=priority`. DAS's priority is its problem's length block ahead of the row's
position: block x BLOCK_STRIDE + position, where blocks come from `workers.rollout.priority.LengthPredictor`
(problems whose expected lengths the evidence separates, longest first, block 0).

Blocks are only comparable when one predictor numbers them. verl splits each batch across its agent loop workers
(separate processes, often on several nodes), and one vLLM server serves requests of all of them, so the
predictor lives in the one process every request already passes through: verl's router actor
(`llm_client._load_balancer`, DAS's `ProblemAffinityLoadBalancer` or verl's own). It is kept there as an
attribute of the router object and reached with Ray's `__ray_call__`, so it works with either router class:
- agent loops report each complete response's length (`report_length`, fire and forget);
- DAS's managers ask once per batch, before it fans out, for every row's priority (`batch_priorities`) and
  write it into the batch's `priority` column, which verl hands to each row's agent loop (and verl's legacy
  manager keeps, since it fills the column only when absent). Positions are the rows' places in the whole batch
  (verl's V1 manager assigns none).

A problem without history gets the block around the pool's mean (`LengthPredictor.blocks`), the middle of the
scale: neither first to start nor, under KV pressure, first to be preempted (docs/verl.md, "The tail first").
The lengths live as long as the router actor (the trainer's run); a restarted trainer starts from none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from workers.rollout.priority import LengthPredictor

# Larger than any batch's positions: a block outranks every position.
BLOCK_STRIDE = 1 << 24
# The router object's attribute that holds the predictor.
_ATTRIBUTE = "_das_lengths"


def _predictor(balancer: Any) -> LengthPredictor:
    predictor = getattr(balancer, _ATTRIBUTE, None)
    if predictor is None:
        predictor = LengthPredictor()
        setattr(balancer, _ATTRIBUTE, predictor)
    return predictor


def _observe(balancer: Any, lengths: list[tuple[str, int]]) -> None:
    """Runs inside the router actor: finished responses' lengths."""
    predictor = _predictor(balancer)
    for problem_id, length in lengths:
        predictor.observe(problem_id, length)


def _blocks(balancer: Any, problem_ids: list[str | None], max_tokens: int | None) -> list[int]:
    """Runs inside the router actor: each row's block on the one scale."""
    predictor = _predictor(balancer)
    predictor.max_tokens = max_tokens
    return predictor.blocks(problem_ids).tolist()


def report_length(client: Any, problem_id: str | None, length: int) -> bool:
    """Tells the router actor of verl's LLM server client `client` that a response of `problem_id` finished
    with `length` tokens, without waiting; False (nothing sent) for a client without a router or a request
    without a problem."""
    load_balancer = getattr(client, "_load_balancer", None)
    if problem_id is None or load_balancer is None:
        return False
    load_balancer.__ray_call__.remote(_observe, [(problem_id, int(length))])
    return True


def batch_priorities(
    load_balancer: Any, problem_ids: Iterable[str | None], max_tokens: int | None
) -> list[int]:
    """verl `priority` values for a batch's rows (lower runs first): each row's problem block on the router's
    one scale, x BLOCK_STRIDE, plus the row's position in the batch.

    Args:
        load_balancer: the router actor handle of verl's LLM server client (`llm_client._load_balancer`).
        problem_ids: one per row, None for a row without one.
        max_tokens: the response cap (`rollout.response_length`): expected lengths are cut there.
    """
    import ray

    rows = [p if isinstance(p, str) else None for p in problem_ids]
    blocks = ray.get(load_balancer.__ray_call__.remote(_blocks, rows, max_tokens))
    return priorities_from_blocks(blocks)


def priorities_from_blocks(blocks: Sequence[int]) -> list[int]:
    """block x BLOCK_STRIDE + position, per row."""
    if len(blocks) >= BLOCK_STRIDE:
        raise ValueError(f"a batch of {len(blocks)} rows does not fit under BLOCK_STRIDE ({BLOCK_STRIDE})")
    return [int(block) * BLOCK_STRIDE + position for position, block in enumerate(blocks)]
