"""The proposer's settings (`ProposerSettings`), validated once: vLLM spawns the worker that builds the
proposer, so they come from `DAS_*` variables. No numba here: `das` reads these defaults in processes that
start vLLM's CPU engine, which fails to start when numba was imported first."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError
from pydantic.dataclasses import dataclass

from history_store.automaton.config import DEFAULT_WINDOW_EPOCHS, DOCUMENTED, DraftConfig
from workers.budget.config import BUDGET_MIN_TOKEN_PROB
from workers.errors import InvalidInput


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise InvalidInput(f"{name}={raw!r} is not a number") from exc


def _env_threads(name: str) -> int:
    raw = os.environ.get(name, "1")
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidInput(f"{name}={raw!r} is not a positive whole number")
    return int(raw)


# The variable each setting is read from (`ProposerSettings.from_env`).
_ENV = {
    "budget": "DAS_BUDGET",
    "window_epochs": "DAS_WINDOW_EPOCHS",
    "max_depth": "DAS_MAX_DEPTH",
    "min_token_prob": "DAS_MIN_TOKEN_PROB",
    "max_spec_factor": "DAS_MAX_SPEC_FACTOR",
    "max_spec_offset": "DAS_MAX_SPEC_OFFSET",
    "history_dir": "DAS_HISTORY_DIR",
    "catch_up_interval_s": "DAS_CATCH_UP_INTERVAL_S",
    "history_retry_s": "DAS_HISTORY_RETRY_S",
    "history_load": "DAS_HISTORY_LOAD",
    "history_duty": "DAS_HISTORY_DUTY",
    "draft_threads": "DAS_DRAFT_THREADS",
    "remembered_probs": "DAS_REMEMBERED_PROBS",
}


@dataclass(frozen=True, config=DOCUMENTED)
class ProposerSettings:
    """Proposer configuration. Worker processes are spawned by vLLM, so it comes from the environment
    (`from_env`: `DAS_*` variables, listed in docs/engine.md). The drafting defaults are DraftConfig's."""

    budget: bool = True
    """Use the length-aware budget policy (off: every row may draft up to K, cut only by the tree's
    min_token_prob, SuffixDecoding's rule)."""

    window_epochs: Annotated[int, Field(ge=1)] = DEFAULT_WINDOW_EPOCHS
    """Epochs of history kept per problem (the sliding window)."""

    max_depth: Annotated[int, Field(ge=1)] = DraftConfig.max_depth
    """Longest context suffix matched (`DraftConfig.max_depth`)."""

    min_token_prob: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """The tree's probability floor; None takes the default for `budget`: BUDGET_MIN_TOKEN_PROB with the
    budget on, DraftConfig's without."""

    max_spec_factor: Annotated[float, Field(ge=0.0)] = DraftConfig.max_spec_factor
    """`DraftConfig.max_spec_factor`."""

    max_spec_offset: float = DraftConfig.max_spec_offset
    """`DraftConfig.max_spec_offset`."""

    history_dir: str | None = None
    """The node's history replica (distributed mode); None in embedded mode."""

    catch_up_interval_s: Annotated[float, Field(gt=0.0)] = 0.2
    """Seconds between catch-ups with the replica: one costs a RocksDB catch-up (milliseconds, holding the
    GIL), and a few per second keep history fresher than the one-second freshness target."""

    history_retry_s: Annotated[float, Field(gt=0.0)] = 5.0
    """Seconds between attempts to open a replica that was missing, empty or did not open (the proposer drafts
    without history meanwhile; the attempts run on a thread of their own, off the decode step)."""

    history_load: Literal["lazy", "eager"] = "lazy"
    """`lazy`: build a problem's history tree on its first request (or prefetch); `eager`: all at start."""

    history_duty: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    """The largest share of wall time the history thread may hold the trees between decode steps
    (`workers.generator.history_feed`); what it cannot do within it queues, and new rollouts then skip the
    global tree. Its pieces start only when the next step is not due, so a larger share costs the step little
    and takes more history in: at 100k tokens/s of ingest, 0.3 against 0.1 left 599 against 966 of 1,694
    rollouts out of the global tree at batch 64, and 991 against 1,174 at batch 256, with the step's p99 within
    the runs' noise (`das bench ingest`, docs/benchmarks.md)."""

    draft_threads: Annotated[int, Field(ge=1)] = 1
    """Threads drafting a batch of 64 rows or more may use (`history_store.automaton.draft_threads`); the
    drafts do not depend on it. One unless asked: more helped only on a machine measured here, and hurt in
    vLLM's CPU engine."""

    remembered_probs: bool = DraftConfig.remembered_probs
    """`DraftConfig.remembered_probs` (`DAS_REMEMBERED_PROBS=on|off`)."""

    def __post_init__(self) -> None:
        if self.min_token_prob is None:
            default = BUDGET_MIN_TOKEN_PROB if self.budget else DraftConfig.min_token_prob
            object.__setattr__(self, "min_token_prob", default)

    def drafting(self, k: int) -> DraftConfig:
        """The drafter's settings for an engine drafting at most k tokens per step."""
        return DraftConfig(
            max_depth=self.max_depth,
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob,
            remembered_probs=self.remembered_probs,
        )

    @classmethod
    def from_env(cls) -> ProposerSettings:
        """Settings from `DAS_*` variables (unset: the field's default); raises ValueError naming the
        variable that does not parse or is out of range."""
        env = os.environ
        budget = env.get("DAS_BUDGET", "on").lower()
        if budget not in ("on", "off"):
            raise InvalidInput(f"DAS_BUDGET must be 'on' or 'off', got {budget!r}")
        given: dict[str, Any] = {"budget": budget == "on", "history_dir": env.get("DAS_HISTORY_DIR") or None}
        remembered = env.get("DAS_REMEMBERED_PROBS")
        if remembered is not None:
            if remembered.lower() not in ("on", "off"):
                raise InvalidInput(f"DAS_REMEMBERED_PROBS must be 'on' or 'off', got {remembered!r}")
            given["remembered_probs"] = remembered.lower() == "on"
        if "DAS_HISTORY_LOAD" in env:
            given["history_load"] = env["DAS_HISTORY_LOAD"].lower()
        for name in ("window_epochs", "max_depth", "min_token_prob", "max_spec_factor", "max_spec_offset"):
            value = _env_float(_ENV[name], None)
            if value is not None:
                given[name] = int(value) if name in ("window_epochs", "max_depth") else value
        for name in ("catch_up_interval_s", "history_retry_s", "history_duty"):
            seconds = _env_float(_ENV[name], None)
            if seconds is not None:
                given[name] = seconds
        given["draft_threads"] = _env_threads(_ENV["draft_threads"])
        try:
            return cls(**given)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise InvalidInput(f"{_ENV[str(error['loc'][0])]}: {error['msg']}") from None
