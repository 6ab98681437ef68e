"""``@record`` behaves as ``@dataclass(frozen=True, slots=True)`` does, for what kreld uses."""

from __future__ import annotations

import copy
import pickle
import sys
from typing import ClassVar

import pytest

from kreld.core.record import FrozenInstanceError, field, fields, record, replace


@record
class Point:
    """A record with a required field, a default and a factory."""

    x: int
    label: str = "p"
    tags: dict[str, int] = field(default_factory=dict, metadata={"m": 1})
    KIND: ClassVar[str] = "point"  # not a field


@record
class Empty:
    """No fields at all."""


def test_fields_defaults_factories_metadata_and_replace() -> None:
    p = Point(1)
    assert [f.name for f in fields(Point)] == ["x", "label", "tags"]
    assert fields(p)[2].metadata["m"] == 1 and fields(p)[0].metadata == {}
    assert (p.x, p.label, p.tags, p.KIND) == (1, "p", {}, "point")
    assert Point(1).tags is not Point(1).tags  # the factory runs per record
    assert Point(2, label="q", tags={"a": 1}) == Point(2, "q", {"a": 1})
    assert replace(p, label="r") == Point(1, "r") and p.label == "p"
    assert Point.__match_args__ == ("x", "label", "tags")
    match Point(3, "m"):
        case Point(x, label):
            assert (x, label) == (3, "m")
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        replace(p, nope=1)
    with pytest.raises(TypeError):
        fields(object())


def test_a_subclass_adds_its_fields_after_its_base_s() -> None:
    @record
    class Labelled(Point):
        colour: str = "red"

    c = Labelled(1, colour="blue")
    assert [f.name for f in fields(c)] == ["x", "label", "tags", "colour"]
    assert (c.x, c.label, c.colour) == (1, "p", "blue") and c != Point(1)


def test_a_record_is_frozen_and_slotted() -> None:
    p = Point(1)
    with pytest.raises(FrozenInstanceError):
        p.x = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):  # FrozenInstanceError is one
        del p.label  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        p.__dict__  # noqa: B018 - slots: no instance dict
    assert p.x == 1


def test_equality_and_hash_follow_the_compared_fields_and_the_class() -> None:
    @record
    class Other:
        x: int
        label: str = "p"
        note: str = field(default="", compare=False)

    assert Point(1, "a") == Point(1, "a") and Point(1, "a") != Point(1, "b")
    assert Point(1, "p") != Other(1, "p")  # same values, another class
    assert hash(Other(3, "z")) == hash(Other(3, "z"))
    assert len({Other(3, "z"), Other(3, "z"), Other(4, "z")}) == 2
    assert Other(3, "z", note="a") == Other(3, "z", note="b")  # compare=False
    assert Empty() == Empty() and hash(Empty()) == hash(Empty())
    assert repr(Point(1, "a")) == "Point(x=1, label='a', tags={})"


def test_copy_and_pickle_rebuild_a_record_through_its_init() -> None:
    p = Point(5, "five", {"k": 5})
    for again in (copy.copy(p), copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert again == p and again is not p
        assert type(again) is Point


def test_what_it_does_not_carry_out_is_refused_not_ignored() -> None:
    with pytest.raises(TypeError, match="without a default follows"):

        @record
        class Misordered:
            x: int = 0
            y: int  # type: ignore[misc]

    with pytest.raises(ValueError):
        field(default=0, default_factory=int)
    with pytest.raises(TypeError, match="__post_init__"):

        @record
        class PostInit:
            x: int

            def __post_init__(self) -> None:
                pass


def test_kreldctl_s_store_reads_never_import_dataclasses_or_inspect() -> None:
    """The other reason: importing dataclasses imports inspect (ast, dis, tokenize)."""
    import subprocess

    code = (
        "import sys, kreld.cli, kreld.server.methods, kreld.store, kreld.store.lmdbcheck; "
        "print(sorted(m for m in ('dataclasses', 'inspect') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
