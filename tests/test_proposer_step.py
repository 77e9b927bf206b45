"""The proposer outside vLLM: it finds the runner whichever shape vLLM wraps it in, its step drafts from
history and learns from verification, and it follows the node's replica (a real RocksDB secondary) the same
way the history service's own reader does: quarantine drops one record, a reload drops what left the store,
and the global tree keeps the writer's apply order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _store_workload import Workload
from numba import njit, types
from rocksdict import Options, Rdict

from history_store.automaton.problem_index import ProblemIndex
from history_store.durable import layout
from history_store.durable.store import HistoryStore
from history_store.indexed_history import load_index
from history_store.native.bundles import members
from pipeline.schemas import TrajectoryRecord
from workers.bench.proposer import _build, _engine_for, decoding
from workers.bench.replay import load_traces
from workers.generator import proposer as proposer_module
from workers.generator.proposer import DasProposer
from workers.generator.step import DirectCall, pack_tables
from workers.generator.step import decode_step as _decode_step_dispatcher
from workers.generator.step_tables import StepGroups

K = 8
MAX_LEN = 4096
WORKLOAD = Workload(problems=3, epochs=2, samples=3, min_len=30, max_len=60)


class StandInRunner:
    """What the proposer reads of vLLM's model runner: the batch's request ids and the requests; vLLM calls
    `propose` from a runner method, as `draft` does here."""

    def __init__(self, drafter: object) -> None:
        self.drafter = drafter
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}
        self.token_ids = np.zeros((4, MAX_LEN), np.int32)
        self.num_tokens = np.zeros(4, np.int32)

    def add(self, row: int, key: str, prompt: list[int], problem_id: str) -> None:
        self.input_batch.req_ids.append(key)
        self.requests[key] = SimpleNamespace(
            num_prompt_tokens=len(prompt),
            sampling_params=SimpleNamespace(extra_args={"das_problem_id": problem_id}, max_tokens=None),
        )
        self.token_ids[row, : len(prompt)] = prompt
        self.num_tokens[row] = len(prompt)

    def commit(self, row: int, tokens: list[int]) -> None:
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def draft(self, sampled: list[list[int]]) -> list[list[int]]:
        return self.drafter.propose(sampled, self.num_tokens, self.token_ids)


class CustomClassProposer:
    """The wrapper some vLLM versions put around a custom proposer."""

    def __init__(self, user_proposer: DasProposer) -> None:
        self.user_proposer = user_proposer

    def propose(self, *args: object, **kwargs: object) -> list[list[int]]:
        return self.user_proposer.propose(*args, **kwargs)


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "CustomClassProposer"])
def test_the_runner_is_found_whether_or_not_vllm_wraps_the_proposer(wrapped: bool) -> None:
    proposer = DasProposer.standalone(K, MAX_LEN)
    history = list(range(100, 160))
    proposer.add_trajectories(
        [{"problem_id": "p", "epoch": 0, "sample": 0, "prompt_ids": [1, 2, 3], "response_ids": history}]
    )
    runner = StandInRunner(CustomClassProposer(proposer) if wrapped else proposer)
    runner.add(0, "r0", [1, 2, 3], "p")
    runner.commit(0, history[:1])  # the prefill's sampled token
    drafts = runner.draft([history[:1]])
    assert proposer.runner is runner
    assert drafts[0] and drafts[0] == history[1 : 1 + len(drafts[0])]
    # Verification accepts the whole draft plus one token; the next step learns that acceptance.
    accepted = drafts[0] + [history[1 + len(drafts[0])]]
    runner.commit(0, accepted)
    runner.draft([accepted])
    stats = proposer.stats()
    assert stats["accepted_tokens"] == len(drafts[0]) and stats["errors"] == 0


def test_a_paused_proposer_drafts_nothing_and_picks_the_batch_up_again_when_resumed() -> None:
    """`pause_drafting` (the e2e bench's "floor": vLLM's speculative path without drafts): while paused every
    row gets no draft; resumed, the requests that ran meanwhile are registered and drafted for."""
    proposer = DasProposer.standalone(K, MAX_LEN)
    history = list(range(100, 160))
    proposer.add_trajectories(
        [{"problem_id": "p", "epoch": 0, "sample": 0, "prompt_ids": [1, 2, 3], "response_ids": history}]
    )
    runner = StandInRunner(proposer)
    proposer.runner = runner
    runner.add(0, "r0", [1, 2, 3], "p")
    runner.commit(0, history[:1])
    proposer.pause_drafting(True)
    assert runner.draft([history[:1]]) == [[]]
    runner.commit(0, history[1:3])
    assert runner.draft([history[1:3]]) == [[]]
    assert proposer.stats()["draft_tokens"] == 0
    proposer.pause_drafting(False)
    runner.commit(0, history[3:4])
    drafts = runner.draft([history[3:4]])
    assert drafts[0] and drafts[0] == history[4 : 4 + len(drafts[0])]
    assert proposer.stats()["errors"] == 0


class VerifiedRows:
    """Requests of their own problems, each decoding exactly its problem's history, stepped through the
    proposer with whatever rows the test names; verification accepts each draft and one token more."""

    def __init__(self, problems: int) -> None:
        self.proposer = DasProposer.standalone(K, MAX_LEN)
        keys = "abcdefgh"[:problems]
        self.histories = {key: list(range(100 + 100 * i, 160 + 100 * i)) for i, key in enumerate(keys)}
        self.proposer.add_trajectories(
            [
                {"problem_id": f"p{key}", "epoch": 0, "sample": 0, "prompt_ids": [1, 2, 3], "response_ids": h}
                for key, h in self.histories.items()
            ]
        )
        self.requests = {
            key: SimpleNamespace(
                num_prompt_tokens=3,
                sampling_params=SimpleNamespace(extra_args={"das_problem_id": f"p{key}"}, max_tokens=None),
            )
            for key in keys
        }
        self.committed = dict.fromkeys(keys, 1)  # response tokens so far: the prefill's sampled token

    def step(self, req_ids: list[str]) -> None:
        token_ids = np.zeros((len(req_ids), 64), np.int32)
        num_tokens = np.zeros(len(req_ids), np.int32)
        for row, key in enumerate(req_ids):
            tokens = [1, 2, 3, *self.histories[key][: self.committed[key]]]
            token_ids[row, : len(tokens)] = tokens
            num_tokens[row] = len(tokens)
        drafts = self.proposer.step(req_ids, num_tokens, token_ids, self.requests)
        assert len(drafts) == len(req_ids)
        for row, key in enumerate(req_ids):
            done, draft = self.committed[key], drafts[row]
            assert draft and draft == self.histories[key][done : done + len(draft)]
            self.committed[key] += len(draft) + 1

    def check_sequences(self) -> None:
        """Each request's committed tokens went to its own sequence."""
        for key, history in self.histories.items():
            have = self.proposer.index.request_tokens(key).tolist()
            assert have == [1, 2, 3, *history[: self.committed[key]]][: len(have)]
        assert self.proposer.stats()["errors"] == 0


def test_rows_swapped_in_place_in_the_list_of_request_ids_are_looked_up_again() -> None:
    """The proposer keeps the last step's slots while the rows stay the same; vLLM rewrites its list of
    request ids in place (it condenses the batch when a request leaves), so the same list object with other
    contents must not count as the same rows."""
    rows = VerifiedRows(2)
    req_ids = ["a", "b"]
    rows.step(req_ids)
    req_ids[:] = ["b", "a"]  # the same list object
    rows.step(req_ids)
    req_ids.reverse()
    rows.step(req_ids)
    rows.check_sequences()


def test_preempted_rows_leave_and_rejoin_the_batch_without_starting_or_finishing() -> None:
    """vLLM preempts a request under memory pressure: it leaves the batch but stays among the runner's
    requests, so nothing starts or finishes, and it comes back later. The step follows the batch size all the
    same: one draft per row, each from the row's own request."""
    rows = VerifiedRows(3)
    for req_ids in (["a", "b", "c"], ["a", "b"], ["a", "b"], ["a", "b", "c"], ["c", "a"], ["a", "b", "c"]):
        rows.step(req_ids)
    rows.check_sequences()


def test_the_budget_knows_each_requests_cap_from_max_tokens_and_the_model_length() -> None:
    proposer = DasProposer.standalone(K, MAX_LEN)
    runner = StandInRunner(proposer)
    runner.add(0, "capped", [7, 8, 9], "q")
    runner.requests["capped"].sampling_params.max_tokens = 384
    runner.add(1, "open", [7, 8, 9, 10], "q")  # no max_tokens: the model's length bounds it
    runner.draft([[1], [1]])
    caps = proposer.policy.max_length[[proposer.index.slot("capped"), proposer.index.slot("open")]]
    assert caps.tolist() == [384, MAX_LEN - 4]


def test_a_request_that_ends_by_itself_with_epoch_and_sample_enters_its_problem_history() -> None:
    proposer = DasProposer.standalone(K, MAX_LEN)
    runner = StandInRunner(proposer)
    response = list(range(500, 540))
    runner.add(0, "r0", [7, 8, 9], "q")
    runner.requests["r0"].sampling_params.extra_args.update(das_epoch=0, das_sample=1)
    runner.requests["r0"].sampling_params.max_tokens = len(response)  # it ends by itself, at max_tokens
    runner.commit(0, response)
    runner.draft([response])
    del runner.requests["r0"]  # vLLM drops a finished request from the runner
    runner.input_batch.req_ids.clear()
    runner.draft([])
    stats = proposer.index.problem_stats("q")
    assert stats["samples"] == 1 and stats["response_lengths"] == [len(response)]


def _proposer_on(replica: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DasProposer:
    monkeypatch.setenv("DAS_HISTORY_DIR", str(replica))
    monkeypatch.setenv("DAS_SECONDARY_DIR", str(tmp_path / "secondary"))
    proposer = DasProposer.standalone(K, MAX_LEN)
    proposer.load_model()
    return proposer


def _alter_stored_bytes(path: Path, key: tuple[str, int, int]) -> None:
    """Flips a token bit of one stored record behind the writer's back (the writer must be closed)."""
    families = {name: Options(raw_mode=True) for name in layout.COLUMN_FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    family = db.get_column_family(layout.CF_TRAJECTORIES)
    raw = bytearray(family[layout.trajectory_key(*key)])
    raw[-5] ^= 0x10
    family[layout.trajectory_key(*key)] = bytes(raw)
    del family
    db.close()


def test_a_quarantined_record_leaves_the_proposer_alone_not_its_whole_epoch(tmp_path, monkeypatch) -> None:
    path = tmp_path / "replica"
    with HistoryStore(path, window_epochs=3) as store:
        store.apply(WORKLOAD.stream())
    proposer = _proposer_on(path, tmp_path, monkeypatch)
    assert proposer.index.problem_stats("problem-1")["samples"] == WORKLOAD.epochs * WORKLOAD.samples
    bad = ("problem-1", 1, 0)
    _alter_stored_bytes(path, bad)
    with HistoryStore(path) as store:
        assert store.get(*bad) is None  # the writer finds the damage and quarantines the record
        proposer.catch_up()
    stats = proposer.index.problem_stats("problem-1")
    assert stats["epochs"] == [0, 1]
    assert stats["samples"] == WORKLOAD.epochs * WORKLOAD.samples - 1


def test_a_reload_after_the_change_log_was_trimmed_drops_what_left_the_store(tmp_path, monkeypatch) -> None:
    path = tmp_path / "replica"
    with HistoryStore(path, window_epochs=3, sequence_retention=2) as store:
        store.apply(WORKLOAD.stream())
    proposer = _proposer_on(path, tmp_path, monkeypatch)
    assert proposer.index.problem_stats("problem-0")["epochs"] == [0, 1]
    proposer.prefetch(["problem-0"])  # one tree built before the reload (the others are loaded lazily after)
    # The window shrinks to one epoch (epoch 0 leaves the store), then enough writes trim the change log past
    # what the proposer has read: it can only reload.
    with HistoryStore(path, window_epochs=1, sequence_retention=2) as store:
        store.apply([WORKLOAD.record(p, 1, 9) for p in range(WORKLOAD.problems)])
        proposer.catch_up()
        fresh = ProblemIndex(window_epochs=3)
        load_index(store, fresh)
        proposer.prefetch([f"problem-{p}" for p in range(WORKLOAD.problems)])
    for p in range(WORKLOAD.problems):
        problem_id = f"problem-{p}"
        assert proposer.index.problem_stats(problem_id)["epochs"] == [1]
        assert proposer.index.problem_stats(problem_id) == fresh.problem_stats(problem_id)
    assert proposer.index.global_keys() == fresh.global_keys()


def test_the_global_tree_follows_the_writers_apply_order_not_key_order(tmp_path, monkeypatch) -> None:
    path = tmp_path / "replica"

    def record(problem_id: str, sample: int) -> TrajectoryRecord:
        return TrajectoryRecord(
            problem_id=problem_id, epoch=0, sample=sample, prompt_ids=[1], response_ids=[2, 3, sample]
        )

    first = [record("zeta", 1), record("alpha", 2), record("mid", 0)]
    later = [record("beta", 5), record("alpha", 0)]
    with HistoryStore(path, window_epochs=3) as store:
        store.apply(first)
        proposer = _proposer_on(path, tmp_path, monkeypatch)
        store.apply(later)
        proposer.catch_up()
    applied = [(r.problem_id, r.epoch, r.sample) for r in first + later]
    assert proposer.index.global_keys() == applied


def test_metrics_of_a_step_are_tallied_once_per_step_and_match_per_row_observations() -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, cls: str) -> float:
        return REGISTRY.get_sample_value(name, {"length_class": cls}) or 0.0

    classes = ("short", "medium", "long")
    before = {
        c: (sample("das_speculation_budget_tokens_count", c), sample("das_speculation_budget_tokens_sum", c))
        for c in classes
    }
    drafted_before = REGISTRY.get_sample_value("das_draft_tokens_total") or 0.0
    proposer = DasProposer.standalone(K, MAX_LEN)
    history = list(range(200, 260))
    proposer.add_trajectories(
        [{"problem_id": "m", "epoch": 0, "sample": 0, "prompt_ids": [4, 5], "response_ids": history}]
    )
    runner = StandInRunner(proposer)
    for row in range(3):
        runner.add(row, f"m{row}", [4, 5], "m")
        runner.commit(row, history[: row + 1])
    drafts = runner.draft([history[:1]] * 3)
    rows_counted = sum(sample("das_speculation_budget_tokens_count", c) - before[c][0] for c in classes)
    tokens_counted = sum(sample("das_speculation_budget_tokens_sum", c) - before[c][1] for c in classes)
    assert rows_counted == 3
    assert tokens_counted == sum(map(len, drafts)) > 0
    assert (REGISTRY.get_sample_value("das_draft_tokens_total") or 0.0) - drafted_before == tokens_counted


def test_packed_step_tables_are_reused_only_while_every_array_they_hold_is_current(monkeypatch) -> None:
    """The proposer packs the step kernels' tables once and reuses them until growth replaced an array they
    hold (request slots, problem rows, the arena, also when the index grows mid-step) or the batch size
    changes; requests joining and finishing and history added and evicted between steps replace nothing. Every reused table must hold what a fresh pack would, and a run that
    reuses them must draft exactly as one that packs them afresh every step; the engine's clock is modelled,
    so the budget's cost model sees the same step times in both."""
    records = load_traces(Path(__file__).resolve().parent.parent / "data" / "dev_rollouts.jsonl")
    max_len = max(len(r.prompt_ids) + len(r.response_ids) for r in records) + K + 2
    last_epoch = max(r.epoch for r in records)
    extra = [r for r in records if r.epoch == last_epoch][:12]

    # Every field of packed tables, as numbers: an array's address and size, a setting's value.
    def leaves(path: str, kind: types.Type) -> list[str]:
        if isinstance(kind, types.BaseNamedTuple):  # a bundle: its members
            return [
                leaf
                for name, member in zip(kind.fields, kind, strict=True)
                for leaf in leaves(f"{path}.{name}", member)
            ]
        return [f"{path}.ctypes.data, {path}.size" if isinstance(kind, types.Array) else path]

    fields = [leaf for name, kind in members(StepGroups) for leaf in leaves(f"t.{name}", kind)]
    namespace: dict = {}
    exec(f"def contents(t):\n    return ({', '.join(fields)},)", namespace)
    contents = njit(namespace["contents"])
    pack = proposer_module.DasProposer._tables
    reused = 0

    def checked_tables(self: DasProposer, n: int):  # noqa: ANN202
        nonlocal reused
        before = self._step_tables
        tables = pack(self, n)
        if tables is before:
            reused += 1
            assert contents(tables) == contents(pack_tables(self._table_sources(n))), (
                "reused tables hold a replaced array"
            )
        return tables

    def run(repack_every_step: bool) -> list[list[list[int]]]:
        monkeypatch.setattr(
            proposer_module.DasProposer, "_tables", pack if repack_every_step else checked_tables
        )
        proposer, live, history, last = _build(records, K, max_len)
        steps = []
        for batch, n_steps in ((5, 60), (40, 120), (7, 60)):
            engine = _engine_for(proposer, live, history, last, batch, max_len)
            for i in range(n_steps):
                if repack_every_step:
                    proposer._step_tables = None
                if batch == 40 and i == 30:  # history arrives and leaves between steps (the replica, verl)
                    proposer.add_trajectories([r.model_dump() | {"epoch": last + 5} for r in extra])
                if batch == 40 and i == 90:
                    proposer.evict(extra[0].problem_id, last + 6)
                drafts = proposer.step(engine.req_ids(), engine.num_tokens, engine.token_ids, engine.requests)
                steps.append(drafts)
                engine.verify(drafts)
            for key in list(engine.requests):  # the batch ends: its requests leave the engine
                del engine.requests[key]
            proposer.step([], np.zeros(0, np.int32), engine.token_ids[:0], engine.requests)
        assert proposer.stats()["errors"] == 0
        return steps

    repacked = run(repack_every_step=True)
    reused_drafts = run(repack_every_step=False)
    assert reused > 100, "the tables must be reused between steps"
    assert sum(len(d) for drafts in reused_drafts for d in drafts) > 1000, "the workload must draft"
    for i, (a, b) in enumerate(zip(repacked, reused_drafts, strict=True)):
        assert a == b, f"step {i} drafted differently with reused tables"


def test_the_step_kernel_called_past_numbas_dispatcher_drafts_exactly_as_through_it(monkeypatch) -> None:
    """`DirectCall` reuses the compiled entry point while the tables keep their type: the proposer must draft
    exactly as through numba's dispatcher, and token counts of another dtype (int64, or vLLM's int32 in a
    strided view) must be normalized on entry, not read by an entry point compiled for contiguous int32."""
    records = load_traces(Path(__file__).resolve().parent.parent / "data" / "dev_rollouts.jsonl")

    def run(kernel: object, counts_of=lambda c: c) -> list[list[list[int]]]:  # noqa: ANN001
        monkeypatch.setattr(proposer_module, "decode_step", kernel)
        proposer, engine = decoding(records, K, 24)
        steps = []
        for _ in range(150):
            counts = counts_of(engine.num_tokens)
            drafts = proposer.step(engine.req_ids(), counts, engine.token_ids, engine.requests)
            steps.append(drafts)
            engine.verify(drafts)
        assert proposer.stats()["errors"] == 0
        return steps

    class CountingDispatcher:  # numba's dispatcher, counting the calls that went through it
        calls = 0

        def __call__(self, *args: object) -> object:
            self.calls += 1
            return _decode_step_dispatcher(*args)

        def __getattr__(self, name: str) -> object:
            return getattr(_decode_step_dispatcher, name)

    dispatcher = CountingDispatcher()
    direct = DirectCall(dispatcher)
    through_dispatcher = run(_decode_step_dispatcher)
    assert sum(len(d) for drafts in through_dispatcher for d in drafts) > 200, "the workload must draft"
    assert run(direct) == through_dispatcher
    assert dispatcher.calls <= 2, "repacked tables of the same type keep the fast path"
    assert run(direct, lambda c: c.astype(np.int64)) == through_dispatcher
    assert run(direct, lambda c: np.repeat(c, 2)[::2]) == through_dispatcher
    assert dispatcher.calls <= 2, "normalized counts keep the fast path"


def test_the_warm_up_compiles_every_kernel_a_step_or_a_piece_may_call() -> None:
    # In a fresh process, so that no other test has compiled them: what the proposer's construction leaves
    # uncompiled is compiled later inside a decode step or a piece that holds it (on a cold cache the
    # mid-step growth's `draft_step` held a measured step of `das bench ingest` for 3.8-4.4 s).
    script = """
import json
from history_store.automaton import kernels, tree_work
from workers.generator import step
from workers.generator.proposer import DasProposer
DasProposer.standalone(8, 4096, publish=False)
kernels_used = {
    "decode_step": step.decode_step, "draft_step": step.draft_step, "feed_seq": tree_work.feed_seq,
    "mirror_pass": tree_work.mirror_pass, "copy_hashes": kernels.copy_hashes,
    "replay_journal": kernels.replay_journal,
}
print(json.dumps({name: len(k.signatures) for name, k in kernels_used.items()}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=str(Path(__file__).resolve().parents[1]),
        env={**os.environ, "DAS_HISTORY_DIR": "/nonexistent/das-history"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(n >= 1 for n in compiled.values()), compiled
