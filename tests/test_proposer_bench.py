"""`das bench proposer` runs the proposer's whole step on a real trace and accounts for where the time goes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from workers.bench import proposer, proposer_ab, proposer_kernels_ab
from workers.bench.proposer_ab import REPO
from workers.bench.replay import load_traces
from workers.cli import main
from workers.generator import proposer as proposer_module

TRACE = Path(__file__).resolve().parent.parent / "data" / "dev_rollouts.jsonl"


def test_the_proposer_bench_decodes_a_trace_and_splits_the_step_time() -> None:
    result = proposer.run(TRACE, k=8, steps=20, warmup=5, batches=(3,), repeats=2)
    [row] = result["batches"]
    assert row["batch"] == 3 and row["steps"] == 20
    assert row["tokens_per_step"] >= 1.0, "every step commits at least one token per row"
    assert 0.0 < row["native_share"] < 1.0
    parts = row["native_us_per_request"] + row["python_us_per_request"]
    assert abs(parts - row["step_wall_us_per_request"]) < 0.01 * row["step_wall_us_per_request"] + 0.01
    assert row["index_step_match_and_draft_best_us_per_request"] > 0
    assert row["allocated_bytes_per_step_peak"] > 0
    assert row["repeats"] == 2 and len(row["step_median_us_per_request_all_runs"]) == 2


def test_paired_ratios_compare_each_round_with_its_partner() -> None:
    pair = proposer_ab.paired([2.0, 3.0, 6.0], [4.0, 3.0, 3.0])
    assert pair["ratio_per_round"] == [0.5, 1.0, 2.0]
    assert pair["ratio_median"] == 1.0 and pair["ratio_min"] == 0.5 and pair["ratio_max"] == 2.0
    assert pair["this_checkout_median"] == 3.0 and pair["against_median"] == 3.0
    assert pair["ratio_of_best"] == 0.6667  # best rounds 2.0 against 3.0, rounded to four places


def test_against_a_revision_runs_both_trees_interleaved(capsys: pytest.CaptureFixture[str]) -> None:
    # HEAD exported with git archive against the working tree: both sides run the real bench in their own
    # process (the export compiles its kernels once, about 45 s here). Outside a git checkout this fails with
    # the command's own one-line error, never skips.
    argv = ["bench", "proposer", str(TRACE), "--against", "HEAD", "--rounds", "2", "--steps", "5"]
    assert main([*argv, "--warmup", "1", "--batches", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["against"]["commit"]) == 40 and result["rounds"] == 2
    [row] = result["batches"]
    assert row["batch"] == 2
    for figure in proposer_ab.FIGURES:
        pair = row[figure]
        assert len(pair["this_checkout"]) == len(pair["against"]) == len(pair["ratio_per_round"]) == 2
        assert all(x > 0 for x in pair["this_checkout"] + pair["against"])


def test_an_unknown_revision_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "proposer", str(TRACE), "--against", "no-such-revision-xyz"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-revision-xyz" in err


def test_kernels_against_a_revision_pairs_steps_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    # HEAD's step kernels, imported as a temporary package (compiled afresh: about 40 s here), against the
    # working tree's: two proposers decode the same rollouts in turns and every steady step is paired.
    before = (proposer_module.decode_step, proposer_module.draft_step, proposer_module.pack_tables)
    argv = ["bench", "proposer", str(TRACE), "--kernels-against", "HEAD", "--steps", "8", "--warmup", "1"]
    assert main([*argv, "--batches", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["kernels_against"]["commit"]) == 40
    [row] = result["batches"]
    assert row["batch"] == 2 and 0 < row["steady_steps_paired"] <= 8
    assert row["this_checkout_median_us_per_request"] > 0 and row["against_median_us_per_request"] > 0
    assert row["ratio_p25"] <= row["ratio_median"] <= row["ratio_p75"]
    kernels = [
        str(REPO / (module.replace(".", "/") + ".py")) for module in proposer_kernels_ab.KERNEL_MODULES
    ]
    if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", *kernels]).returncode == 0:
        assert row["drafts_identical"] and row["first_differing_step"] is None  # the same kernels
    # Nothing of the run is left behind: the proposer steps through this checkout's kernels again.
    assert (proposer_module.decode_step, proposer_module.draft_step, proposer_module.pack_tables) == before
    assert not any(name.startswith(proposer_kernels_ab.PACKAGE) for name in sys.modules)


def test_two_ways_to_compare_at_once_are_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "proposer", str(TRACE), "--against", "HEAD", "--kernels-against", "HEAD"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--kernels-against" in err


def test_kernels_that_do_not_fit_the_proposer_stop_at_the_first_step() -> None:
    # 957d7ae's decode_step took one argument fewer than today's proposer passes ("too many arguments:
    # expected 12, got 13"). The proposer logs such a failure and drafts nothing, so the run must stop at the
    # first step with one clear line rather than time a side that does no work.
    from workers.generator import step as step_kernels

    def decode_step_of_fewer_arguments(tables, slots, num_tokens, step_no, policy_step, joined, seconds,
                                       last_rows, last_tokens, budget_on, bases):  # fmt: skip
        raise AssertionError("never called: the arguments do not fit")

    older = ModuleType("older_kernels")
    older.decode_step = decode_step_of_fewer_arguments
    older.draft_step, older.pack_tables = step_kernels.draft_step, step_kernels.pack_tables
    records = load_traces(TRACE)
    with pytest.raises(ValueError, match="the revision's step kernels fail"):
        proposer_kernels_ab._paired_batch(records, older, batch=2, k=8, steps=5, warmup=1)
