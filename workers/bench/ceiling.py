"""`das bench ceiling`: how much of the budget's error no draft-time evidence can remove.

The budget keeps a draft token when its predicted acceptance pays for verifying it. Under rejection sampling
a draft token is accepted with exactly the target model's probability of it (softmax(logits / T) given the
context before it): the verifier's own information, which only the verification step computes. So a trace,
replayed with das and then scored by the target model teacher-forced over each response, says how far the
budget's predictions are from the best any predictor could do, and how much the signals an engine could
hand the proposer at draft time would add. Reported on every verified draft token (the tokens `das bench
replay` scores as the budget's calibration, one conditional probability per token):
- `brier.policy`: the budget's conditional prediction (its path probability over the previous token's);
- `brier.target_probability`: the target model's own probability of the token, the floor no draft-time
  predictor reaches in expectation;
- `brier.policy_recalibrated` and `brier.with_draft_time_signals`: a logistic recalibration of the policy's
  prediction, alone and with the last sampled token's log probability and the entropy of the distribution
  it was drawn from (what the engine knows when the proposer drafts), each fitted on half of the epochs and
  scored on the other half, both ways;
- `mean_target_probability` against `acceptance`: equal in expectation, a check that exact-match acceptance
  in the replay is rejection sampling's (the trace's sampling settings must be given: `--temperature(s)`);
- `remembered` (a trace whose records carry `response_logprobs`): the share of verified tokens whose history
  remembers how sure the model was, the Brier score of that remembered probability and of the policy on them
  (overall, by match length and by the tree that drafted the token), and `brier_policy_without` / `makespan_s`: the same replay drafting from
  counts alone, the budget's Brier score and projected makespan (default cost model) with and without them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from history_store.automaton.config import DraftConfig
from history_store.automaton.kernels import Source
from pipeline.schemas import TrajectoryRecord
from workers.bench import replay
from workers.bench.cost_model import CostModel
from workers.errors import InvalidInput
from workers.generator.teacher_forcing import TeacherForcedModel

_CLIP = 1e-3  # conditional probabilities are clipped into [_CLIP, 1 - _CLIP] before their log odds


@dataclass
class VerifiedTokens:
    """Every verified draft token of a replay: its request, response position, id, the budget's conditional
    prediction, whether it was accepted, its epoch and its index in the draft."""

    keys: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    draft_index: list[int] = field(default_factory=list)
    remembered: list[float] = field(default_factory=list)  # -1: history holds no sampling probability
    match_lens: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # the tree that drafted it (a kernels.Source)

    def add(self, step: replay.VerifiedStep) -> None:
        assert step.predicted is not None, "only das's steps carry the budget's predictions"
        for row in np.flatnonzero(step.kept > 0).tolist():
            previous = 1.0
            # Token j is tried only if every token before it was accepted; one past the response's end has no
            # target probability (the request stopped there), so it is left out.
            tried = min(int(step.kept[row]), int(step.accepted[row]) + 1, int(step.remaining[row]))
            for j in range(tried):
                path = float(step.predicted[row, j])
                self.keys.append(step.keys[row])
                self.positions.append(int(step.positions[row]) + j)
                self.tokens.append(int(step.tokens[row, j]))
                self.predicted.append(path / previous if previous > 0 else 0.0)
                self.accepted.append(j < int(step.accepted[row]))
                self.epochs.append(step.epoch)
                self.draft_index.append(j)
                self.remembered.append(float(step.remembered[row, j]))
                self.match_lens.append(int(step.match_lens[row]))
                self.sources.append(int(step.sources[row]))
                previous = path


def verified_tokens(
    records: list[TrajectoryRecord], k: int, remembered: bool = DraftConfig.remembered_probs
) -> tuple[VerifiedTokens, float]:
    """Replays the records with das (default cost model, K = k) and collects its verified draft tokens;
    returns them and the projected makespan."""
    found = VerifiedTokens()
    sim = replay.simulate(
        records, "das", DraftConfig(max_spec_tokens=k, remembered_probs=remembered), on_verified=found.add
    )
    return found, replay.summarize(sim, CostModel())["projected_makespan_s"]


# Match lengths the remembered report splits by: from a short match the remembered probability is the model's
# confidence in other contexts, from a long one in nearly this one.
_MATCH_BANDS = ((0, 4), (4, 16), (16, 1 << 30))


def remembered_report(records: list[TrajectoryRecord], k: int) -> dict[str, Any] | None:
    """The `remembered` section (module docstring): das replayed with the remembered probabilities and
    without; None when no record carries them."""
    if not any(r.response_logprobs is not None for r in records):
        return None
    found, makespan = verified_tokens(records, k, remembered=True)
    y = np.asarray(found.accepted, np.float64)
    predicted = np.asarray(found.predicted)
    mem = np.asarray(found.remembered)
    match = np.asarray(found.match_lens)
    known = mem >= 0
    without, makespan_without = verified_tokens(records, k, remembered=False)
    y0, p0 = np.asarray(without.accepted, np.float64), np.asarray(without.predicted)
    bands = []
    for lo, hi in _MATCH_BANDS:
        part = known & (match >= lo) & (match < hi)
        if part.any():
            bands.append(
                {
                    "match_lengths": f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+",
                    "tokens": int(part.sum()),
                    "acceptance": round(float(y[part].mean()), 4),
                    "mean_remembered": round(float(mem[part].mean()), 4),
                    "brier_remembered": round(_brier(mem[part], y[part]), 4),
                    "brier_policy": round(_brier(predicted[part], y[part]), 4),
                }
            )
    source = np.asarray(found.sources)
    by_source = []
    for s in Source:
        part = source == int(s)
        if s is Source.NONE or not part.any():
            continue
        with_it = part & known
        by_source.append(
            {
                "source": s.label,
                "tokens": int(part.sum()),
                "share_remembered": round(float(with_it.sum() / part.sum()), 4),
                "brier_remembered": round(_brier(mem[with_it], y[with_it]), 4) if with_it.any() else None,
                "brier_policy": round(_brier(predicted[part], y[part]), 4),
            }
        )
    return {
        "tokens": int(y.shape[0]),
        "acceptance": round(float(y.mean()), 4),
        "share": round(float(known.mean()), 4),
        "by_source": by_source,
        "brier_remembered": round(_brier(mem[known], y[known]), 4) if known.any() else None,
        "brier_policy_where_known": round(_brier(predicted[known], y[known]), 4) if known.any() else None,
        "by_match_length": bands,
        "brier_policy": round(_brier(predicted, y), 4),
        "brier_policy_without": round(_brier(p0, y0), 4),
        "makespan_s": {"with": round(makespan, 3), "without": round(makespan_without, 3)},
    }


def target_probabilities(
    records: list[TrajectoryRecord], found: VerifiedTokens, model_dir: Path, temperatures: dict[int, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each verified token: the target model's probability of it, and the log probability and entropy of
    the token sampled just before it (the last one the engine knows when the proposer drafts), from the model
    teacher-forced over prompt + response."""
    import torch

    wanted: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(found.keys):
        wanted[key].append(i)
    chosen = [r for r in records if f"{r.problem_id}/{r.epoch}/{r.sample}" in wanted]

    def rows(record: TrajectoryRecord) -> list[int]:
        prompt = len(record.prompt_ids)
        positions = [
            found.positions[i] for i in wanted[f"{record.problem_id}/{record.epoch}/{record.sample}"]
        ]
        # Response token p is predicted at sequence index prompt + p - 1; the token before it, p - 1 (a draft
        # never starts at p = 0: the first token comes from the prefill), at prompt + p - 2.
        return [prompt + p - 1 for p in positions] + [prompt + p - 2 for p in positions]

    n = len(found.keys)
    probability, last_logprob, last_entropy = np.zeros(n), np.zeros(n), np.zeros(n)
    for index, logits in TeacherForcedModel(model_dir).logits(chosen, rows):
        record = chosen[index]
        wanted_rows = wanted[f"{record.problem_id}/{record.epoch}/{record.sample}"]
        temperature = temperatures[record.epoch]
        if temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
        else:  # greedy: the argmax has probability 1
            logp = torch.full_like(logits, -torch.inf)
            logp.scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
        here, before = logp[: len(wanted_rows)], logp[len(wanted_rows) :]
        drafted = torch.tensor([found.tokens[i] for i in wanted_rows])
        sampled = torch.tensor([record.response_ids[found.positions[i] - 1] for i in wanted_rows])
        p_before = before.exp()
        entropy = -(p_before * torch.nan_to_num(before, neginf=0.0)).sum(-1)
        picked = torch.arange(len(wanted_rows))
        probability[wanted_rows] = here[picked, drafted].exp().numpy()
        last_logprob[wanted_rows] = np.maximum(before[picked, sampled].numpy(), -30.0)
        last_entropy[wanted_rows] = entropy.numpy()
    return probability, last_logprob, last_entropy


def _fit_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 50) -> np.ndarray:
    w = np.zeros(x.shape[1])
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        curvature = (x * (p * (1.0 - p))[:, None]).T @ x + 1e-3 * np.eye(x.shape[1])
        w -= np.linalg.solve(curvature, x.T @ (p - y))
    return w


def _cross_fitted_brier(x: np.ndarray, y: np.ndarray, fold: np.ndarray) -> float | None:
    """Brier score of a logistic fit on one fold scored on the other, both ways (None with one fold empty)."""
    if fold.all() or not fold.any():
        return None
    squared = 0.0
    for train in (fold, ~fold):
        w = _fit_logistic(x[train], y[train])
        p = 1.0 / (1.0 + np.exp(-(x[~train] @ w)))
        squared += float(((p - y[~train]) ** 2).sum())
    return squared / y.shape[0]


def _brier(p: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((p - y) ** 2))


def ceiling(
    records: list[TrajectoryRecord], temperatures: dict[int, float], model_dir: Path, k: int = 16
) -> dict[str, Any]:
    """The report `das bench ceiling` prints (module docstring).

    Raises:
        ValueError: a trace epoch has no temperature, or the replay verified no draft token.
    """
    missing = sorted({r.epoch for r in records} - temperatures.keys())
    if missing:
        raise InvalidInput(
            f"no sampling temperature for epoch(s) {missing}: pass --temperature or --temperatures"
        )
    found, makespan = verified_tokens(records, k)
    if not found.keys:
        raise InvalidInput("the replay verified no draft token: nothing to score")
    target, last_logprob, last_entropy = target_probabilities(records, found, model_dir, temperatures)
    y = np.asarray(found.accepted, np.float64)
    predicted = np.asarray(found.predicted)
    clipped = np.clip(predicted, _CLIP, 1.0 - _CLIP)
    log_odds = np.log(clipped / (1.0 - clipped))
    ones = np.ones_like(y)
    epochs = np.asarray(found.epochs)
    # Halves by epoch parity (a trace of one epoch: by sample parity), so no fit scores tokens of a request,
    # or of an epoch, it saw.
    samples = np.asarray([int(key.rsplit("/", 1)[1]) for key in found.keys])
    fold = epochs % 2 == 0 if len(set(found.epochs)) > 1 else samples % 2 == 0
    later = np.asarray(found.draft_index) > 0
    return {
        "tokens": int(y.shape[0]),
        "acceptance": round(float(y.mean()), 4),
        "mean_target_probability": round(float(target.mean()), 4),
        "brier": {
            "policy": round(_brier(predicted, y), 4),
            "policy_recalibrated": _rounded(_cross_fitted_brier(np.column_stack([ones, log_odds]), y, fold)),
            "with_draft_time_signals": _rounded(
                _cross_fitted_brier(np.column_stack([ones, log_odds, last_logprob, last_entropy]), y, fold)
            ),
            "target_probability": round(_brier(target, y), 4),
        },
        "by_draft_index": [
            {
                "draft_index": name,
                "tokens": int(part.sum()),
                "brier_policy": round(_brier(predicted[part], y[part]), 4),
                "brier_target_probability": round(_brier(target[part], y[part]), 4),
            }
            for name, part in (("first", ~later), ("later", later))
            if part.any()
        ],
        "target_probability_below_0.1": round(float(np.mean(target < 0.1)), 4),
        "target_probability_above_0.9": round(float(np.mean(target > 0.9)), 4),
        "remembered": remembered_report(records, k),
    }


def remembered_only(records: list[TrajectoryRecord], k: int = 16) -> dict[str, Any]:
    """The replay side of the report without the target model (`--remembered-only`): the `remembered` section.

    Raises:
        ValueError: no record carries `response_logprobs`.
    """
    section = remembered_report(records, k)
    if section is None:
        raise InvalidInput(
            "no record carries response_logprobs: annotate the trace first (das traces annotate)"
        )
    return {"remembered": section}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
