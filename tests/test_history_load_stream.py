"""The streamed start-up load (`load_index`: lengths and order first, then only the tokens a tree takes, one
record at a time) builds exactly the index the earlier load built (every record decoded, read again and held in
one list, then `add_trajectories`), eager and lazy, with a global tree that cannot hold everything, remembered
probabilities, records the window dropped and a corrupt record (issue 47, item 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _store_workload import Workload
from rocksdict import Options, Rdict

from history_store.automaton.config import DraftConfig
from history_store.automaton.problem_index import ProblemIndex
from history_store.durable import layout
from history_store.durable.store import HistoryStore
from history_store.indexed_history import load_index
from pipeline.schemas import TrajectoryRecord

WORKLOAD = Workload(problems=7, epochs=5, samples=3, min_len=20, max_len=120)
CONFIG = DraftConfig(max_depth=16, remembered_probs=True)


def _earlier_load(store: HistoryStore, index: ProblemIndex) -> int:
    """The load before issue 47: every record decoded to learn its order, each read again, all held at once."""
    keyed = sorted((t.sequence, (t.problem_id, t.epoch, t.sample)) for t in store.iter_trajectories())
    records = [r for r in (store.get(*key) for _, key in keyed) if r is not None]
    return index.add_trajectories(
        (r.problem_id, r.epoch, r.sample, r.prompt_ids, r.response_ids, r.response_logprobs) for r in records
    )


def _with_logprobs(record: TrajectoryRecord) -> TrajectoryRecord:
    n = len(record.response_ids)
    return record.model_copy(update={"response_logprobs": list(np.linspace(-3.0, 0.0, n))})


def _store(path: Path) -> None:
    stream = WORKLOAD.stream()
    stream = [_with_logprobs(r) if i % 4 == 0 else r for i, r in enumerate(stream)]
    with HistoryStore(path, window_epochs=3) as store:  # epochs 0-1 leave the store's window
        for start in range(0, len(stream), 9):
            store.apply(stream[start : start + 9])
    # One record damaged behind the writer's back: both loads must leave it out the same way.
    families = {name: Options(raw_mode=True) for name in layout.COLUMN_FAMILIES}
    db = Rdict(str(path), Options(raw_mode=True), column_families=families)
    family = db.get_column_family(layout.CF_TRAJECTORIES)
    key = layout.trajectory_key("problem-3", 4, 1)
    raw = bytearray(family[key])
    raw[-5] ^= 0x10
    family[key] = bytes(raw)
    del family
    db.close()


def _state(index: ProblemIndex) -> dict:
    """Everything a load decides: each problem's bookkeeping and tree, the global tree and its order."""
    problems = {}
    for problem_id in index.problem_ids():
        problem = index._problems[problem_id]
        problems[problem_id] = (
            dict(problem.seq_of),
            dict(problem.lengths),
            problem.newest_epoch,
            problem.next_seq,
            problem.tree.to_bytes(),
            index.problem_stats(problem_id),
        )
    return {
        "problems": problems,
        "global": index._global.to_bytes(),
        "global_seq": dict(index._global_seq),
        "global_fifo": list(index._global_fifo),
        "global_next": index._global_next,
        "global_newest": index._global_newest,
    }


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("global_tokens", [1_500, 10**7])  # the global tree holds some, or every, record
def test_the_streamed_load_builds_the_index_the_earlier_load_built(
    lazy: bool, global_tokens: int, tmp_path: Path
) -> None:
    path = tmp_path / "store"
    _store(path)
    with HistoryStore.open_secondary(path, tmp_path / "secondary") as store:
        indexes = [
            ProblemIndex(window_epochs=2, config=CONFIG, global_tokens=global_tokens, lazy=lazy)
            for _ in range(2)
        ]
        earlier = _earlier_load(store, indexes[0])
        report = load_index(store, indexes[1])
        assert report.trajectories == earlier > 0
        assert _state(indexes[1]) == _state(indexes[0])
        assert "problem-3" in indexes[0].problem_ids()
        assert (4, 1) not in indexes[1]._problems["problem-3"].seq_of  # the corrupt record stayed out
        if lazy:  # the trees a first request builds are the same too
            fetched = {}
            for index in indexes:
                index.make_resident("problem-2", lambda p, e, s: _tokens(store, p, e, s))
                fetched[id(index)] = index._problems["problem-2"].tree.to_bytes()
            assert len(set(fetched.values())) == 1 and len(next(iter(fetched.values()))) > 100
        # Drafts from both agree too (what the engine gets).
        context = np.array(WORKLOAD.record(2, 4, 0).response_ids[:12], np.int32)
        drafts = [index._problems["problem-2"].tree.speculate(context) for index in indexes]
        assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()


def _tokens(store, problem_id: str, epoch: int, sample: int):
    record = store.get(problem_id, epoch, sample)
    return None if record is None else (record.prompt_ids, record.response_ids, record.response_logprobs)
