"""`das bench fidelity` names the first step at which a replay's proposer parts from the engine's: the same
batch with other drafts (the budget or the trees differ), or another batch (scheduling, or acceptance before).
And it starts the replay's requests as the engine admitted them: a few at its first steps (`ramp`)."""

from __future__ import annotations

from workers.bench.fidelity import first_parting, ramp


def test_the_first_parting_step_and_its_kind_are_named() -> None:
    engine = [[4, 400, 8], [4, 412, 6], [4, 425, 3], [3, 300, 2]]
    assert first_parting(engine, [list(s) for s in engine]) is None
    drafts = [[4, 400, 8], [4, 412, 6], [4, 425, 5], [3, 300, 2]]
    assert first_parting(engine, drafts) == {
        "step": 2,
        "engine": {"rows": 4, "held_tokens": 425, "drafted": 3},
        "replay": {"rows": 4, "held_tokens": 425, "drafted": 5},
        "same_batch": True,
        "drafted_before": 14,
    }
    batch = [[4, 400, 8], [4, 413, 6]]
    parting = first_parting(engine, batch)
    assert parting is not None and parting["step"] == 1 and not parting["same_batch"]
    assert first_parting(engine, engine[:3]) == {"step": 3, "engine_steps": 4, "replay_steps": 3}


def test_the_ramp_is_the_rows_until_every_request_started_or_one_finished() -> None:
    assert ramp([[1, 60, 0], [32, 1761, 8], [32, 1800, 9], [31, 1700, 3]], 32) == [1, 32]
    assert ramp([[3, 180, 0], [9, 500, 2], [9, 520, 1], [20, 1200, 4], [18, 1100, 2]], 24) == [3, 9, 9, 20]
    assert ramp([[40, 100, 0]], 32) == [32]
    assert ramp([], 32) == []
