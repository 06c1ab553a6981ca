"""`model.source`: a discriminated union; the strings of earlier configs are shorthand for its members."""

import pytest

from relax_bus.errors import ConfigError
from workers.config import DirSource, HfSource, TinyMoeSource, TinyOmniSource, TinySource, parse_config


def source_of(value):
    return parse_config({"run": "r", "model": {"source": value}}).model.source


@pytest.mark.parametrize(
    ("shorthand", "member"),
    [
        ("tiny", TinySource(hidden=128, layers=2)),
        ("tiny:64x3", TinySource(hidden=64, layers=3)),
        ("tiny-moe", TinyMoeSource(type="tiny-moe")),
        ("tiny-omni", TinyOmniSource(type="tiny-omni")),
        ("hf:HuggingFaceTB/SmolLM2-135M", HfSource(type="hf", id="HuggingFaceTB/SmolLM2-135M")),
        ("hf:org/model@v1.0", HfSource(type="hf", id="org/model", revision="v1.0")),
        ("/models/smollm2", DirSource(type="dir", path="/models/smollm2")),
        ("~/smollm2", DirSource(type="dir", path="~/smollm2")),
    ],
)
def test_each_shorthand_string_parses_to_its_member(shorthand, member):
    source = source_of(shorthand)
    assert source == member
    assert source_of(source.shorthand()) == member  # the shorthand round-trips


@pytest.mark.parametrize(
    ("mapping", "member"),
    [
        ({"type": "tiny", "hidden": 256, "layers": 4}, TinySource(hidden=256, layers=4)),
        ({"type": "tiny"}, TinySource()),
        ({"type": "tiny-moe"}, TinyMoeSource(type="tiny-moe")),
        ({"type": "tiny-omni"}, TinyOmniSource(type="tiny-omni")),
        ({"type": "dir", "path": "/m"}, DirSource(type="dir", path="/m")),
        ({"type": "hf", "id": "org/m", "revision": "abc123"}, HfSource(type="hf", id="org/m", revision="abc123")),
    ],
)
def test_structured_forms(mapping, member):
    assert source_of(mapping) == member


def test_the_default_is_the_tiny_llama_and_a_dumped_config_validates_again():
    config = parse_config({"run": "r"})
    assert config.model.source == TinySource(hidden=128, layers=2)
    again = parse_config(config.model_dump(mode="json"))
    assert again.model.source == config.model.source
    assert parse_config({"run": "r", "model": {"source": "tiny:64x2"}}).model_dump()["model"]["source"] == {
        "type": "tiny",
        "hidden": 64,
        "layers": 2,
    }


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("tiny:12x1", "model.source.tiny.hidden: Input should be a multiple of 8"),
        ("tiny:big", "model.source: tiny source 'tiny:big': expected tiny:<hidden>x<layers>"),
        ({"type": "gguf"}, "model.source: unknown type 'gguf'"),
        ({"type": "hf"}, "model.source.hf.id: Field required"),
        ({"type": "tiny", "experts": 8}, "model.source.tiny.experts: unknown setting"),
    ],
)
def test_bad_sources_are_one_line_each(value, problem):
    with pytest.raises(ConfigError) as err:
        source_of(value)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems
