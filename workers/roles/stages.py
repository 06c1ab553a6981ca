"""Start-up stages on the run's events: what a role is doing before the first step shows it.

A role announces each stage it enters while it starts (loading its model, warming up, its first engine call) as a
`stage` run event; `relax run` prints them as they come (`workers.launch.progress`), so that a model that takes a
minute to load is never a minute of silence. Announcements are news for people only: nothing reads them back.
"""

from __future__ import annotations

from typing import Any

from relax_bus.bus import Bus
from schemas import RunEvent

STAGE_EVENT = "stage"
"""The name of the run event of a stage; its field `stage` says which, in a few words."""


async def announce_stage(bus: Bus, source: str, stage: str, **fields: Any) -> None:
    """Publish that `source` (a role or a worker id) enters `stage` (e.g. "loading model"), with `fields`."""
    event = RunEvent(run=bus.run, event=STAGE_EVENT, source=source, fields={"stage": stage, **fields})
    await bus.publish("events", event)
