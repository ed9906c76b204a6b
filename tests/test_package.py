"""The package's public names: all of them importable, the checkpoint ones (orbax, tensorstore) at their first use."""

import pytest

import flaxstate


def test_every_public_name_resolves_and_is_listed():
    for name in flaxstate.__all__:
        assert getattr(flaxstate, name) is not None, name
    assert set(flaxstate.__all__) <= set(dir(flaxstate))
    namespace: dict = {}
    exec("from flaxstate import *", namespace)
    assert set(flaxstate.__all__) <= set(namespace)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'CheckpointFileWritter'"):
        flaxstate.CheckpointFileWritter  # noqa: B018
