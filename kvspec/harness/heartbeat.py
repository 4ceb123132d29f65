"""A heartbeat: call a function every few seconds from a background thread while
long work runs (fuzzing, a replay), so that a log is never silent for minutes."""
from __future__ import annotations

import threading
from typing import Callable


def periodic(beat: Callable[[], None] | None, every: float) -> threading.Event:
    """Call ``beat`` every ``every`` seconds until the returned event is set; the
    first call comes after ``every`` seconds, so short work prints nothing. With
    no ``beat``, nothing runs."""
    stop = threading.Event()
    if beat is None:
        return stop

    def loop() -> None:
        while not stop.wait(every):
            beat()

    threading.Thread(target=loop, name="kvspec-heartbeat", daemon=True).start()
    return stop
