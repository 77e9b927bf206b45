"""`das bench tree`: insertion speed, batched drafting speed and memory of the suffix trees.

Workload (documented in docs/benchmarks.md): per problem, 16 sequences of 4,000 tokens from a skewed Markov token
process (each next token is a Zipf-distributed pick among a few successors of the previous token), so
contexts recur as they do in rollouts of one problem; depth 64; drafts of up to 16 tokens. With
`remembered_probs` the trees keep remembered sampling probabilities (`DraftConfig.remembered_probs`) and every
response token carries one, drawn uniformly from the (0.05, 1) range, so the memory and the time they cost show.
"""

from __future__ import annotations

import time

import numpy as np

from history_store.automaton.config import DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from history_store.automaton.suffix_tree import SuffixTree, as_levels

VOCAB = 4096
SEQS_PER_PROBLEM = 16
SEQ_TOKENS = 4000


def markov_sequences(
    rng: np.random.Generator, n_seqs: int, length: int, zipf_a: float = 1.3
) -> list[np.ndarray]:
    """Sequences of a Markov chain whose successor choice is Zipf-skewed (a = zipf_a)."""
    successors = rng.integers(0, VOCAB, size=(VOCAB, 64))
    out = []
    for _ in range(n_seqs):
        picks = np.minimum(rng.zipf(zipf_a, size=length) - 1, 63)
        seq = np.empty(length, np.int32)
        tok = int(rng.integers(0, VOCAB))
        for i in range(length):
            tok = int(successors[tok, picks[i]])
            seq[i] = tok
        out.append(seq)
    return out


def sampled_logprobs(seq: np.ndarray, config: DraftConfig) -> np.ndarray | None:
    """Log probabilities for a sequence's tokens where the trees remember them (None otherwise), from their own
    generator so that the token workload is the same either way."""
    if not config.remembered_probs:
        return None
    return np.log(np.random.default_rng(seq[:8].tolist()).uniform(0.05, 1.0, seq.shape[0]))


def bench_insert(seqs: list[np.ndarray], config: DraftConfig) -> dict:
    # Compile outside the timing, growing the arena too: its rehash kernel would compile in the timed insert.
    SuffixTree(config).extend(0, seqs[0])
    levels = [as_levels(sampled_logprobs(seq, config), seq.shape[0]) for seq in seqs]
    tree = SuffixTree(config)
    start = time.perf_counter()
    for i, seq in enumerate(seqs):
        tree.extend(i, seq, levels[i])
    chunked = time.perf_counter() - start
    single = SuffixTree(config)
    start = time.perf_counter()
    for tok in seqs[0][:2000].tolist():
        single.extend(0, [tok])
    one_by_one = time.perf_counter() - start
    n = sum(s.shape[0] for s in seqs)
    return {
        "insert_us_per_token": 1e6 * chunked / n,
        "insert_us_per_token_one_call_per_token": 1e6 * one_by_one / 2000,
        "bytes_per_token": tree.memory_bytes / n,
        "states_per_token": tree.num_states / n,
        "tokens": n,
    }


def bench_draft(rng: np.random.Generator, batch: int, config: DraftConfig, steps: int = 200) -> dict:
    """Per-step cost of one batched draft call for `batch` live requests over several problems' trees."""
    n_problems = max(1, min(batch, 16))
    index = ProblemIndex(window_epochs=2, config=config)
    held_out = {}
    for p in range(n_problems):
        seqs = markov_sequences(rng, SEQS_PER_PROBLEM + 1, SEQ_TOKENS // 4)
        for s, seq in enumerate(seqs[:-1]):
            index.add_trajectory(f"p{p}", 0, s, seq[:32], seq[32:], sampled_logprobs(seq[32:], config))
        held_out[p] = seqs[-1]
    keys = [f"r{i}" for i in range(batch)]
    for i, key in enumerate(keys):
        index.start_request(key, f"p{i % n_problems}", held_out[i % n_problems][:64])
    budgets = np.full(batch, config.max_spec_tokens, np.int32)
    index.draft_batch(keys, budgets)  # first call matches from scratch (and compiles)
    warm = index.forest  # load the append kernel outside the timing, on a throwaway tree
    SuffixTree(config, warm).extend(0, [1])
    index.start_request("warmup", None, [1, 2])
    index.append_batch(["warmup"], [[3]])
    index.finish_request("warmup")
    draft_s = append_s = 0.0
    drafted = 0
    for step in range(steps):
        step_tokens = [held_out[i % n_problems][64 + step : 65 + step] for i in range(batch)]
        start = time.perf_counter()
        index.append_batch(keys, step_tokens)
        append_s += time.perf_counter() - start
        start = time.perf_counter()
        out = index.draft_batch(keys, budgets)
        draft_s += time.perf_counter() - start
        drafted += int(out.lengths.sum())
    return {
        "speculate_us_per_request": 1e6 * draft_s / (steps * batch),
        "append_us_per_request": 1e6 * append_s / (steps * batch),
        "mean_draft_tokens": drafted / (steps * batch),
    }


def run(seed: int = 0, remembered_probs: bool = False) -> dict:
    """The bench's JSON; `remembered_probs` builds the trees with remembered sampling probabilities."""
    config = DraftConfig(max_depth=64, max_spec_tokens=16, remembered_probs=remembered_probs)
    rng = np.random.default_rng(seed)
    result = {
        "workload": f"{SEQS_PER_PROBLEM} sequences x {SEQ_TOKENS} tokens per problem, Zipf-Markov, depth 64, K 16",
        "remembered_probs": remembered_probs,
        **bench_insert(markov_sequences(rng, SEQS_PER_PROBLEM, SEQ_TOKENS), config),
    }
    for batch in (1, 64, 256):
        for key, value in bench_draft(rng, batch, config).items():
            result[f"{key}_batch{batch}"] = value
    result["targets"] = {
        "insert_us_per_token": 1.0,
        "speculate_us_per_request_batch256": 5.0,
        "bytes_per_token": 64,
    }
    return result
