import msgpack
import pytest
from pydantic import ValidationError

from schemas import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    AudioPart,
    ChatTurn,
    DeadLetter,
    ImagePart,
    InvalidMessage,
    MalformedPayload,
    MediaRef,
    Metric,
    RunEvent,
    Sample,
    ScoredGroup,
    TensorError,
    TrainGroup,
    UnknownKind,
    UnknownSchemaVersion,
    VideoPart,
    WeightsAnnouncement,
    WireTensor,
    WorkerHeartbeat,
    decode,
    encode,
    peek_kind,
)
from tests import factories as f


def every_message():
    p = f.prompt("r1", 3)
    r = f.rollout(p, version=2)
    s = f.scored(r)
    turns = (ChatTurn(role="system", content="Be brief."), ChatTurn(role="user", content="hi"))
    history = (*turns, ChatTurn(role="assistant", content="hello"))
    conversation = p.model_copy(update={"group_id": "g3-chat", "history": history})  # its own publish id
    return [
        p,
        conversation,
        r,
        f.routed(r.model_copy(update={"prompt": p.model_copy(update={"group_id": "g3-moe"})})),
        s,
        TrainGroup(
            scored=s,
            ref_logprobs=(WireTensor.from_values([-0.4, -0.2], "float32"),) * 2,
        ),
        WeightsAnnouncement(run="r1", version=4, location="v4", size=123, digest="sha256:" + "0" * 64),
        WorkerHeartbeat(
            run="r1",
            role="rollout",
            worker_id="w",
            pid=1,
            host="h",
            started_at=1.0,
            counters={"processed": 2},
        ),
        RunEvent(run="r1", event="group_dropped", fields={"lag": 3, "reason": "stale"}),
        Metric(run="r1", step=1, values={"reward_mean": 0.5}),
        DeadLetter(run="r1", reason="bad", source_subject="relax.r1.prompts", stream_seq=4, payload=b"\x00\x01"),
    ]


def test_every_kind_is_covered():
    assert {m.kind for m in every_message()} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("message", every_message(), ids=lambda m: m.kind)
def test_round_trip(message):
    data = encode(message)
    back = decode(data)
    assert back == message
    assert type(back) is type(message)
    assert peek_kind(data) == (message.kind, SCHEMA_VERSION)


def test_tensors_travel_as_bytes_not_lists():
    r = f.rollout(f.prompt("r1"))
    raw = msgpack.unpackb(encode(r), raw=False)
    lp = raw["samples"][0]["logprobs"]
    assert lp["dtype"] == "float32" and lp["shape"] == [2] and isinstance(lp["data"], bytes)


def test_tensor_values_round_trip():
    t = WireTensor.from_values([1, -2, 3, 4, 5, 6], "int64", shape=(2, 3))
    assert t.numel == 6 and t.to_values() == [1, -2, 3, 4, 5, 6]


def test_tensor_size_mismatch_is_refused():
    with pytest.raises((TensorError, ValidationError), match="needs 8 bytes, got 4"):
        WireTensor(dtype="float32", shape=(2,), data=b"\x00" * 4)


def test_sample_needs_aligned_tokens_and_logprobs():
    with pytest.raises(ValidationError, match="differs from logprobs shape"):
        Sample(
            token_ids=WireTensor.from_values([1, 2], "int32"),
            logprobs=WireTensor.from_values([0.1], "float32"),
        )


def test_scored_group_needs_one_reward_per_sample():
    r = f.rollout(f.prompt("r1", n=2))
    with pytest.raises(ValidationError, match="1 rewards for 2 samples"):
        ScoredGroup(rollout=r, rewards=(1.0,))


def test_media_parts_need_inline_or_ref():
    ImagePart(mime="image/png", inline=b"png", width=2, height=2)
    AudioPart(mime="audio/wav", ref=MediaRef(uri="file:///a.wav"), duration_s=1.5)
    VideoPart(mime="video/mp4", ref=MediaRef(digest="sha256:" + "a" * 64), fps=30)
    with pytest.raises(ValidationError, match="exactly one of inline or ref"):
        ImagePart(mime="image/png")
    with pytest.raises(ValidationError, match="exactly one of digest or uri"):
        MediaRef(digest="sha256:" + "a" * 64, uri="file:///x")
    with pytest.raises(ValidationError):
        MediaRef(digest="md5:abc")


def test_messages_are_frozen():
    p = f.prompt("r1")
    with pytest.raises(ValidationError):
        p.attempt = 3  # type: ignore[misc]


def test_truncated_payload_is_malformed():
    data = encode(f.rollout(f.prompt("r1")))
    with pytest.raises(MalformedPayload, match="not valid msgpack"):
        decode(data[: len(data) // 2])


def test_non_map_payload_is_malformed():
    with pytest.raises(MalformedPayload, match="not a map"):
        decode(msgpack.packb([1, 2, 3]))


def test_garbage_is_malformed():
    with pytest.raises(MalformedPayload):
        decode(b"\xc1\xc1\xc1 not msgpack")


def test_missing_kind_is_malformed():
    with pytest.raises(MalformedPayload, match="no 'kind'"):
        decode(msgpack.packb({"schema_version": "1.0"}))


def test_unknown_kind_is_named():
    with pytest.raises(UnknownKind, match="unknown message kind 'banana'"):
        decode(msgpack.packb({"kind": "banana", "schema_version": "1.0"}))


def test_expected_kind_is_enforced():
    with pytest.raises(UnknownKind, match="expected a 'train_group' message, got 'prompt_group'"):
        decode(encode(f.prompt("r1")), TrainGroup)


def test_unknown_major_version_is_refused():
    raw = msgpack.unpackb(encode(f.prompt("r1")), raw=False)
    raw["schema_version"] = "2.0"
    with pytest.raises(UnknownSchemaVersion, match=r"prompt_group schema version 2\.0 is not supported"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_newer_minor_version_with_extra_field_is_accepted():
    raw = msgpack.unpackb(encode(f.prompt("r1")), raw=False)
    raw["schema_version"] = "1.99"
    raw["future_field"] = 42
    back = decode(msgpack.packb(raw, use_bin_type=True))
    assert back.group_id == "g0" and back.schema_version == "1.99"


def test_invalid_fields_are_named():
    raw = msgpack.unpackb(encode(f.prompt("r1")), raw=False)
    raw["n_samples"] = 0
    del raw["run"]
    with pytest.raises(InvalidMessage, match=r"invalid prompt_group message: .*run: Field required.*n_samples"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_invalid_utf8_in_a_string_is_named():
    data = encode(f.prompt("r1", text="@@@")).replace(b"@@@", b"\xff\xed\xa0")
    with pytest.raises(MalformedPayload, match="has a string that is not valid UTF-8: 'utf-8' codec can't decode"):
        decode(data)


def test_a_lone_surrogate_cannot_be_encoded():
    with pytest.raises(InvalidMessage, match=r"prompt_group message cannot be encoded: .*'\\udcff' at position 1"):
        encode(f.prompt("r1", text="a\udcffb"))
