"""`BackgroundPublisher`: hands finished trajectories to the bus without ever blocking or failing a rollout.

verl's agent loops run on one event loop per worker process; opening a Kafka bus connects to the brokers (seconds
when they are away) and `publish` can refuse records under backpressure. Rollouts must not wait for either:
DAS only speeds them up. So the bus is opened lazily, on a background thread, retrying with exponential backoff
(the first failure is logged once, the eventual connection once); records wait in a bounded queue meanwhile and
the oldest are dropped, counted and logged once, when it is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.bus import DEFAULT_QUEUE_RECORDS, EMBEDDED_URL, Bus, BusBackpressureError, BusError, open_bus
from pipeline.kafka_config import parse_bus_url
from pipeline.schemas import TrajectoryRecord

logger = logging.getLogger(__name__)

# Backoff between attempts to open the bus: quick first retries (a broker restarting), then once a minute.
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 60.0


def check_bus_url(url: str) -> None:
    """Raises ValueError for a bus URL that no retry can fix (checked where the config is loaded)."""
    if url != EMBEDDED_URL:
        parse_bus_url(url)


class BackgroundPublisher:
    """A bus that is opened, and fed, by a daemon thread; `publish` only appends to a bounded queue."""

    def __init__(
        self,
        url: str,
        settings: Mapping[str, Any] | None = None,
        max_queue_records: int = DEFAULT_QUEUE_RECORDS,
        opener: Callable[..., Bus] = open_bus,
    ) -> None:
        """Raises ValueError for a malformed bus URL (see `check_bus_url`)."""
        check_bus_url(url)
        self.url = url
        self._settings = dict(settings or {})
        self._opener = opener
        self._queue: deque[TrajectoryRecord] = deque()
        self._max = max_queue_records
        self._cond = threading.Condition()
        self.bus: Bus | None = None
        self.attempts = 0
        self.dropped = 0
        self.delivered = 0
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="das-bus-publisher", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self.bus is not None

    def publish(self, record: TrajectoryRecord) -> None:
        """Queues the record for the bus; never blocks, never raises. The oldest record is dropped (and
        counted) when the queue is full."""
        with self._cond:
            if len(self._queue) >= self._max:
                self._queue.popleft()
                self.dropped += 1
                self._warn_once(
                    "full",
                    f"DAS: {self._max} trajectories wait for the bus {self.url}; dropping the oldest "
                    "(they only miss from the shared history)",
                )
            self._queue.append(record)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        delay = FIRST_RETRY_S
        while self.bus is None:
            self.attempts += 1
            try:
                self.bus = self._opener(self.url, **self._settings)
            except Exception as exc:  # any failure to connect is retried: the broker may come up later
                self._warn_once(
                    "open", f"DAS: cannot open the bus {self.url} ({exc}); retrying in the background"
                )
                time.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_S)
        if "open" in self._warned:
            logger.warning("DAS: bus %s open after %d attempts", self.url, self.attempts)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                record = self._queue[0]
            taken = True
            try:
                self.bus.publish(record)
            except BusBackpressureError:
                time.sleep(0.1)  # the bus is draining; the record stays first in line
                continue
            except BusError as exc:
                taken = False
                self._warn_once("publish", f"DAS: the bus {self.url} lost trajectories: {exc}")
            with self._cond:
                self._queue.popleft()
                if taken:
                    self.delivered += 1
                else:
                    self.dropped += 1

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message)
