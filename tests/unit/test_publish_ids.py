"""Each message type defines its own publish id (or says it has none), and the ids are what they were."""

import pytest

from relax_bus.envelope import message_id
from schemas import (
    GROUP_MESSAGES,
    MESSAGE_TYPES,
    DeadLetter,
    Message,
    Metric,
    RunEvent,
    TrainGroup,
    WeightsAnnouncement,
)
from tests import factories as f


def _concrete(base: type[Message]) -> set[type[Message]]:
    found = set()
    for sub in base.__subclasses__():
        if "kind" in sub.model_fields and sub.__module__ != __name__:  # not the types this module makes up
            found.add(sub)
        found |= _concrete(sub)
    return found


def test_every_message_type_defines_its_publish_id_or_declares_none():
    types = _concrete(Message)
    assert types >= set(MESSAGE_TYPES.values())
    for cls in types:
        defines = cls.publish_id is not Message.publish_id
        assert defines or not cls.deduplicated, f"{cls.__name__}: no publish_id() and not declared id-less"


def test_a_type_without_a_publish_id_is_refused_when_defined():
    with pytest.raises(TypeError, match="defines no publish_id"):

        class Undeclared(Message):
            pass

    class Declared(Message):  # the way out for a type whose publishes are never deduplicated
        deduplicated = False

    assert Declared().publish_id() is None


def test_publish_ids_are_unchanged():
    p = f.prompt("run1", 3, attempt=2)
    r = f.rollout(p)
    s = f.scored(r)
    t = f.train("run1", 3, attempt=2)
    g = p.group_id
    assert message_id(p) == f"run1/{g}/prompt/2"
    assert message_id(r) == f"run1/{g}/rollout/2"
    assert message_id(s) == f"run1/{g}/scored/2"
    assert message_id(t) == f"run1/{t.group_id}/train/2"
    w = WeightsAnnouncement(run="run1", version=7, location="v7", size=1)
    assert message_id(w) == "run1/weights/7"
    letter = DeadLetter(run="run1", reason="x", source_subject="relax.run1.prompts", stream_seq=12)
    assert message_id(letter) == "run1/dlq/relax.run1.prompts/12"
    assert message_id(letter.model_copy(update={"stream_seq": None})) is None
    assert message_id(RunEvent(run="run1", event="e")) is None
    assert message_id(Metric(run="run1", step=1, values={})) is None


def test_every_stage_of_a_group_knows_its_prompt_and_id():
    p = f.prompt("run1", 5)
    r = f.rollout(p)
    s = f.scored(r)
    t = TrainGroup(scored=s)
    for m in (p, r, s, t):
        assert isinstance(m, GROUP_MESSAGES)
        assert m.prompt == p and m.group_id == p.group_id
