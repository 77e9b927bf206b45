"""`das bench replay TRACES.jsonl`: replay recorded rollouts with each drafting strategy and cost model."""

from __future__ import annotations

import argparse
from pathlib import Path

from history_store.automaton.config import DraftConfig
from workers.bench.cost_model import CostModel
from workers.bench.engines import ORDERS
from workers.cli.types import NON_NEGATIVE, POSITIVE, UsageError, add_json_flag, number
from workers.errors import InvalidInput
from workers.generator.settings import ProposerSettings

# The flags' defaults are the configs' (one home per default).
DRAFT, COST, SETTINGS = DraftConfig(), CostModel(), ProposerSettings()


def register(cli) -> None:
    parser = cli.command(
        "bench",
        "replay",
        help="Replay recorded rollouts token by token and compare drafting strategies.",
        run=run,
    )
    parser.add_argument(
        "traces",
        help="JSON Lines of trajectory records (problem_id, epoch, sample, prompt_ids, response_ids)",
    )
    add_json_flag(parser)
    parser.add_argument("--strategies", default=None, help="comma-separated subset (default: all)")
    parser.add_argument(
        "--cost-models",
        default="default,memory-bound,compute-bound",
        help="comma-separated: default (the --c-* flags), memory-bound (c_tok 0.01 ms), "
        "compute-bound (c_tok 0.1 ms, c_seq 0.3 ms)",
    )
    parser.add_argument(
        "--max-draft", type=POSITIVE, default=DRAFT.max_spec_tokens, help="maximum draft tokens per step (K)"
    )
    parser.add_argument(
        "--window", type=POSITIVE, default=SETTINGS.window_epochs, help="epochs of history per problem (das)"
    )
    parser.add_argument(
        "--depth", type=POSITIVE, default=DRAFT.max_depth, help="longest context suffix matched"
    )
    parser.add_argument(
        "--min-token-prob",
        type=number(0, 1),
        default=DRAFT.min_token_prob,
        help="tree probability floor of das-unbudgeted (suffix-* keep SuffixDecoding's 0.1; das and oracle "
        "let the budget decide)",
    )
    parser.add_argument(
        "--max-spec-factor",
        type=number(0),
        default=DRAFT.max_spec_factor,
        help="draft <= factor x match length",
    )
    parser.add_argument("--max-spec-offset", type=number(), default=DRAFT.max_spec_offset)
    parser.add_argument(
        "--escape", type=number(0), default=DRAFT.escape, help="pseudo-count of unseen continuations (das)"
    )
    parser.add_argument(
        "--remembered-probs",
        action="store_true",
        default=DRAFT.remembered_probs,
        help="das's budget weighs each draft token's remembered sampling probability, where the trace carries "
        "response_logprobs (data/annotated/)",
    )
    parser.add_argument(
        "--longest-match",
        action="store_true",
        help="draft from the longest matching suffix only, not the best of every match length",
    )
    parser.add_argument("--c-base", type=number(0), default=COST.c_base, help="verifier step cost, seconds")
    parser.add_argument(
        "--c-seq", type=number(0), default=COST.c_seq, help="verifier cost per active request, seconds"
    )
    parser.add_argument(
        "--c-tok", type=number(0), default=COST.c_tok, help="verifier cost per verified token, seconds"
    )
    parser.add_argument(
        "--cost-model",
        type=Path,
        default=None,
        help="JSON whose cost_model (c_base, c_seq, c_tok in seconds) replaces the --c-* flags: what das bench "
        "verifier writes",
    )
    parser.add_argument(
        "--progress", action="store_true", help="print a line per strategy and epoch to stderr"
    )
    parser.add_argument(
        "--max-num-seqs",
        default=None,
        help="finite engines: comma-separated slot settings, each slots per engine (32), a share of an "
        "epoch's requests over all engines (1/4) or unlimited; requests queue for slots (default: every "
        "request of an epoch at once)",
    )
    parser.add_argument(
        "--order",
        default=",".join(ORDERS),
        help="comma-separated admission orders with --max-num-seqs: fcfs (verl's layout), random, predicted "
        "(DAS's length prediction), group-oracle (each problem's true mean length, groups together), oracle "
        "(true length, longest first)",
    )
    parser.add_argument(
        "--engines", type=POSITIVE, default=1, help="engines the requests are spread over (--max-num-seqs)"
    )
    parser.add_argument(
        "--router",
        choices=("round-robin", "problem"),
        default="round-robin",
        help="how requests are spread over --engines: verl's round-robin or DAS's problem-keyed routing",
    )
    parser.add_argument(
        "--kv-tokens",
        type=POSITIVE,
        default=None,
        help="KV cache per engine in tokens (with --max-num-seqs): a request holds its prompt and generated "
        "tokens; when they do not fit the engine preempts as vLLM does and the request recomputes later",
    )
    parser.add_argument("--order-seed", type=NON_NEGATIVE, default=0, help="seed of the random order")
    parser.add_argument(
        "--jobs", type=POSITIVE, default=1, help="replays run at a time with --max-num-seqs (processes)"
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from workers.bench import replay

    strategies = [s.strip() for s in (args.strategies or ",".join(replay.STRATEGIES)).split(",") if s.strip()]
    presets = replay.cost_models(_default_cost(args, CostModel))
    names = [s.strip() for s in args.cost_models.split(",") if s.strip()]
    unknown = [n for n in names if n not in presets]
    if unknown or not names:
        raise InvalidInput(f"unknown cost models {unknown}; choose from {', '.join(presets)}")
    config = DraftConfig(
        max_depth=args.depth,
        max_spec_tokens=args.max_draft,
        max_spec_factor=args.max_spec_factor,
        max_spec_offset=args.max_spec_offset,
        min_token_prob=args.min_token_prob,
        escape=args.escape,
        all_matches=not args.longest_match,
        remembered_probs=args.remembered_probs,
    )
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.progress else None
    if args.kv_tokens is not None and args.max_num_seqs is None:
        raise UsageError("--kv-tokens needs --max-num-seqs (use unlimited for every request at once)")
    if args.max_num_seqs is not None:
        return _run_slots(args, strategies, config, {n: presets[n] for n in names}, progress)
    result = replay.run(
        args.traces, strategies, config, args.window, {n: presets[n] for n in names}, progress=progress
    )
    print(replay.dumps(result) if args.json else replay.main_table(result))
    return 0


def _default_cost(args: argparse.Namespace, cost_model: type):
    """The `default` cost model: the --cost-model file's, else the --c-* flags'."""
    if args.cost_model is None:
        return cost_model(args.c_base, args.c_seq, args.c_tok)
    import json

    try:
        fields = json.loads(args.cost_model.read_text())["cost_model"]
        values = [float(fields[k]) for k in ("c_base", "c_seq", "c_tok")]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(
            f"--cost-model {args.cost_model}: expected JSON with cost_model {{c_base, c_seq, c_tok}} ({err})"
        ) from None
    if min(values) < 0:
        raise UsageError(f"--cost-model {args.cost_model}: coefficients must be >= 0, got {values}")
    return cost_model(*values)


def _run_slots(args: argparse.Namespace, strategies: list[str], config, costs: dict, progress) -> int:
    from workers.bench import engines, replay, replay_slots

    settings = [
        None if part.strip() == "unlimited" else engines.parse_slots(part.strip())
        for part in args.max_num_seqs.split(",")
        if part.strip()
    ]
    orders = [o.strip() for o in args.order.split(",") if o.strip()]
    unknown = [o for o in orders if o not in engines.ORDERS]
    if unknown or not orders or not settings:
        raise InvalidInput(f"unknown orders {unknown}; choose from {', '.join(engines.ORDERS)}")
    fleet = engines.Engines(1, args.engines, orders[0], args.router, args.order_seed, args.kv_tokens)
    result = replay_slots.run_slots(
        args.traces,
        settings,
        orders,
        fleet,
        {"strategies": strategies, "config": config, "window": args.window, "costs": costs},
        progress,
        args.jobs,
    )
    print(replay.dumps(result) if args.json else replay_slots.slots_table(result))
    return 0
