"""`das bench e2e`'s summary: the ratios to `none` per replicate and per epoch, from measured rows (the engines'
runs are what `_interleaved` returns; here they are given, so the arithmetic is checked exactly)."""

from __future__ import annotations

import pytest

from workers.bench import e2e


def _row(walls: list[float], tokens: list[int]) -> dict:
    return {
        "tokens_per_s": tokens[-1] / walls[-1],
        "mean_accepted_per_step": 0.0,
        "acceptance_rate": 0.0,
        "latency_max_s": walls[-1],
        "output_tokens": tokens[-1],
        "epoch_wall_s": walls,
        "epoch_output_tokens": tokens,
        "outputs": [],
    }


def test_per_epoch_speed_is_compared_per_generated_token_beside_the_wall_time(monkeypatch) -> None:
    # Replicate 0: DAS samples a response twice as long in epoch 1 and takes 1.5x the wall time, so its wall
    # ratio says 0.67x while it generated 1.33x the tokens per second.
    runs = {
        "none": [{1: _row([8.0, 4.0], [100, 64])}, {1: _row([8.0, 8.0], [100, 128])}],
        "das": [{1: _row([8.0, 6.0], [100, 128])}, {1: _row([4.0, 8.0], [100, 128])}],
    }
    monkeypatch.setattr(e2e, "_interleaved", lambda config, progress: runs)
    config = e2e.E2eConfig(strategies=("none", "das"), batches=(1,), repeats=2)
    das = e2e.run(config)["results"]["batch_1"]["strategies"]["das"]
    wall = das["speedup_vs_none_wall_by_epoch"]
    per_token = das["speedup_vs_none_tokens_per_s_by_epoch"]
    assert [wall[0]["min"], wall[0]["max"]] == [1.0, 2.0]
    assert wall[1]["min"] == pytest.approx(4.0 / 6.0, abs=1e-3) and wall[1]["max"] == 1.0
    assert [per_token[0]["min"], per_token[0]["max"]] == [1.0, 2.0]
    assert per_token[1]["min"] == 1.0 and per_token[1]["max"] == pytest.approx(4.0 / 3.0, abs=1e-3)
    # The measured epoch's per-token ratio is the tokens/s ratio.
    assert das["speedup_vs_none_tokens_per_s"]["mean"] == pytest.approx(per_token[1]["mean"], abs=1e-3)
    assert "tok/s by epoch x1.50 x1.17" in e2e.table(e2e.run(config))
