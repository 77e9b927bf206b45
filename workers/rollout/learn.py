"""A small RL loop on the CPU, so traces come from a policy that learns between epochs (`das traces learn`).

Every trace sampled from a fixed model is as predictable from history as a trace can be; DAS's premise is that
history predicts the next epoch while the policy moves. Each epoch here:
1. samples G responses per problem with the vLLM engine at T=1.0, asking for each sampled token's log
   probability (`logprobs=0`), and records the weights' version (`policy_version`);
2. scores them with a reward that varies within groups (`REWARDS`), so group-normalised advantages are
   non-zero;
3. takes one GRPO-style policy-gradient step on those samples with torch (on-policy, so no ratio or clip:
   loss = -sum(A_i * log p(token)) / response tokens, DAPO's token-level mean; AdamW; gradient norm clipped at
   1 as verl does). Only the top `train_layers` decoder layers learn: the frozen rest (embeddings, tied head,
   final norm, lower layers) runs once per sample without a graph, which is what fits 2 shared cores;
4. measures how far the update moved the policy: the mean per-token KL(old || new) over the vocabulary,
   teacher-forced on the epoch's own samples (the frozen layers' output is the same for both policies, so
   only the top layers run twice);
5. saves the weights (safetensors) and has the engine reload them in place before the next epoch.
"""

from __future__ import annotations

import copy
import re
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.schemas import TrajectoryRecord
from workers.errors import InvalidInput

REWARDS = ("overlong", "format")
# A numbered step at the start of a line: "1.", "2)", "Step 3:".
_STEP_LINE = re.compile(r"^\s*(?:\*\*)?(?:step\s*)?(\d+)\s*[.:)]", re.IGNORECASE | re.MULTILINE)


def overlong_reward(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to `max_tokens - buffer`, then falling
    linearly to -1 at the cap. It moves the length distribution, which is what the budget must follow."""
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    return max(-1.0, (free - length) / buffer)


def format_reward(text: str) -> float:
    """1 when the response lays its answer out as numbered steps (lines starting 1. and 2., or Step 1, Step 2),
    else 0. SmolLM2-135M does so in about 14% of its T=1.0 answers to `examples/problems/rl_problems.jsonl`
    (most groups of 8 mixed), so the reward varies within groups from the first epoch."""
    steps = {int(number) for number in _STEP_LINE.findall(text)}
    return 1.0 if {1, 2} <= steps else 0.0


def group_advantages(rewards: Sequence[float], groups: Sequence[str]) -> np.ndarray:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation (0 for a
    group whose rewards are all equal: it carries no signal)."""
    values = np.asarray(rewards, dtype=np.float64)
    out = np.zeros_like(values)
    members: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    for rows in members.values():
        part = values[rows]
        std = part.std()
        if std > 1e-9:
            out[rows] = (part - part.mean()) / std
    return out


@dataclass
class UpdateReport:
    """One policy-gradient step: how far it moved the policy and how it was taken."""

    kl: float  # mean per-token KL(old || new), teacher-forced over the vocabulary on the epoch's samples
    update_norm: float  # ||new - old|| / ||old|| over the trained weights
    engine_logprob_gap: (
        float | None
    )  # mean |engine's sampled log p - trainer's| (the engine runs these weights)
    trained_tokens: int
    seconds: float


class Learner:
    """The policy's trainable copy: a transformers causal LM on the CPU in float32 (the engine's dtype, so the
    engine samples from exactly these weights), its top `train_layers` decoder layers trained by AdamW."""

    def __init__(self, model_dir: Path, train_layers: int, lr: float, micro_batch: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        layers = self.model.model.layers
        if not 1 <= train_layers <= len(layers):
            raise InvalidInput(f"--train-layers must be in 1..{len(layers)}, got {train_layers}")
        self.boundary = len(layers) - train_layers
        self.top = torch.nn.ModuleList(list(layers)[self.boundary :])
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        for parameter in self.top.parameters():
            parameter.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.top.parameters(), lr=lr, weight_decay=0.0)
        self.micro_batch = micro_batch

    def _top_hidden(self, layers: Any, boundary: Any, mask: Any) -> Any:
        """The final (normed) hidden states from the frozen boundary through `layers` (the model's own forward,
        with its layer list swapped for the top ones)."""
        base = self.model.model
        full = base.layers
        base.layers = layers
        try:
            return base(inputs_embeds=boundary, attention_mask=mask).last_hidden_state
        finally:
            base.layers = full

    def update(self, records: Sequence[TrajectoryRecord], advantages: np.ndarray) -> UpdateReport:
        """One step on `records` with their advantages; then the KL between the policies before and after."""
        import torch

        start = time.perf_counter()
        order = sorted(
            range(len(records)), key=lambda i: len(records[i].prompt_ids) + len(records[i].response_ids)
        )
        batches = [order[i : i + self.micro_batch] for i in range(0, len(order), self.micro_batch)]
        total = sum(len(records[i].response_ids) for i in order)
        cached = []
        gaps: list[float] = []
        for batch in batches:
            ids, mask, rows, cols, targets = _teacher_forcing([records[i] for i in batch])
            weights = torch.cat(
                [torch.full((len(records[i].response_ids),), float(advantages[i])) for i in batch]
            )
            # Groups without signal (all rewards equal) give no gradient: their forward needs no graph.
            with torch.set_grad_enabled(bool(weights.abs().sum() > 0)):
                out = self.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                logp = _token_logprobs(self.model.lm_head(out.last_hidden_state[rows, cols]), targets)
                if logp.requires_grad:
                    (-(weights * logp).sum() / total).backward()
            cached.append((out.hidden_states[self.boundary].detach(), mask, rows, cols))
            engine = [records[i].response_logprobs for i in batch]
            if all(e is not None for e in engine):
                gaps.append(float((logp.detach() - torch.tensor(sum(engine, []))).abs().sum()))
        before = copy.deepcopy(self.top)
        torch.nn.utils.clip_grad_norm_(self.top.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        kl = 0.0
        with torch.no_grad():
            moved = sum(
                float((n - o).pow(2).sum())
                for n, o in zip(self.top.parameters(), before.parameters(), strict=True)
            )
            size = sum(float(o.pow(2).sum()) for o in before.parameters())
            for boundary, mask, rows, cols in cached:
                old = torch.log_softmax(
                    self.model.lm_head(self._top_hidden(before, boundary, mask)[rows, cols]), -1
                )
                new = torch.log_softmax(
                    self.model.lm_head(self._top_hidden(self.top, boundary, mask)[rows, cols]), -1
                )
                kl += float((old.exp() * (old - new)).sum())
        return UpdateReport(
            kl=kl / max(total, 1),
            update_norm=(moved / size) ** 0.5,
            engine_logprob_gap=sum(gaps) / total if len(gaps) == len(batches) else None,
            trained_tokens=total,
            seconds=round(time.perf_counter() - start, 1),
        )

    def save(self, folder: Path) -> None:
        """Writes the whole model (safetensors, float32) to `folder`, replacing it whole: a tmp sibling renamed
        into place, so a crash never leaves half a checkpoint where the engine reads."""
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(str(tmp), safe_serialization=True)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)


def _teacher_forcing(records: Sequence[TrajectoryRecord]) -> tuple[Any, Any, Any, Any, Any]:
    """Right-padded prompt + response ids, their mask, and the (row, column) of the position that predicts each
    response token, with those tokens, in record order."""
    import torch

    sequences = [list(r.prompt_ids) + list(r.response_ids) for r in records]
    width = max(map(len, sequences))
    ids = torch.zeros((len(records), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols, targets = [], [], []
    for row, (record, sequence) in enumerate(zip(records, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        prompt, length = len(record.prompt_ids), len(record.response_ids)
        rows.append(torch.full((length,), row))
        cols.append(torch.arange(prompt - 1, prompt + length - 1))
        targets.extend(record.response_ids)
    return ids, mask, torch.cat(rows), torch.cat(cols), torch.tensor(targets)


def _token_logprobs(logits: Any, targets: Any) -> Any:
    import torch

    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


@dataclass(frozen=True)
class LearnSettings:
    """What a learning run does per epoch (the CLI's flags)."""

    reward: str
    epochs: int
    samples: int
    max_tokens: int
    overlong_buffer: int
    lr: float
    train_layers: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.reward not in REWARDS:
            raise InvalidInput(f"reward must be one of {REWARDS}, got {self.reward!r}")
        if self.samples < 2:
            raise InvalidInput("--samples must be >= 2: group-normalised advantages need a group")
        if not 1 <= self.overlong_buffer <= self.max_tokens:
            raise InvalidInput(f"--overlong-buffer must be in 1..--max-tokens ({self.max_tokens})")
        if self.lr <= 0:
            raise InvalidInput("--lr must be > 0")


def score(records: Sequence[TrajectoryRecord], settings: LearnSettings, tokenizer: Any) -> list[float]:
    """Each record's reward under `settings.reward`."""
    if settings.reward == "overlong":
        return [
            overlong_reward(len(r.response_ids), settings.max_tokens, settings.overlong_buffer)
            for r in records
        ]
    return [format_reward(tokenizer.decode(r.response_ids, skip_special_tokens=True)) for r in records]


def epoch_figures(records: Sequence[TrajectoryRecord], rewards: Sequence[float]) -> dict[str, Any]:
    """Mean reward, how many groups carried a signal, mean and p90 length, share capped, response tokens."""
    lengths = np.array([len(r.response_ids) for r in records])
    by_group: dict[str, set[float]] = defaultdict(set)
    for record, reward in zip(records, rewards, strict=True):
        by_group[record.problem_id].add(reward)
    return {
        "responses": len(records),
        "response_tokens": int(lengths.sum()),
        "mean_reward": round(float(np.mean(rewards)), 4),
        "groups_with_signal": sum(len(v) > 1 for v in by_group.values()),
        "groups": len(by_group),
        "mean_length": round(float(lengths.mean()), 1),
        "p90_length": round(float(np.percentile(lengths, 90)), 1),
        "capped_share": round(float(np.mean([r.finish_reason == "length" for r in records])), 4),
    }


def learn(
    llm: Any,
    problems: Sequence[Any],
    settings: LearnSettings,
    learner: Learner,
    tokenizer: Any,
    work_dir: Path,
    sink: Callable[[TrajectoryRecord], None],
    on_epoch: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """Runs the epochs (module docstring); every record goes to `sink`, every epoch's figures to `on_epoch`.
    No update follows the last epoch: its samples are the trace's end."""
    from workers.rollout.worker import RolloutWorker

    worker = RolloutWorker(llm, "none", sink=sink)
    sampling = {"temperature": 1.0, "max_tokens": settings.max_tokens}  # the worker asks for logprobs=0
    reports = []
    for epoch in range(settings.epochs):
        worker.policy_version = epoch
        report, finished = worker.run_epoch(problems, epoch, settings.samples, sampling)
        records = [f.record for f in finished]
        rewards = score(records, settings, tokenizer)
        line: dict[str, Any] = {
            "epoch": epoch,
            "policy_version": epoch,
            **epoch_figures(records, rewards),
            "sample_s": report.wall_s,
            "tokens_per_s": report.tokens_per_s,
        }
        if epoch + 1 < settings.epochs:
            advantages = group_advantages(rewards, [r.problem_id for r in records])
            update = learner.update(records, advantages)
            line["update"] = {k: _round(v) for k, v in asdict(update).items()}
            policy = work_dir / "policy"
            learner.save(policy)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(policy)})
            # Prompt KV cached under the old weights would otherwise be reused by the new policy.
            llm.reset_prefix_cache()
        reports.append(line)
        on_epoch(line)
    return reports


def _round(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value
