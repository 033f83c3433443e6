"""CONVENTIONS ("Handlers take what they use"): GraphQL renders the service's typed views,
the same ones REST renders. Every GraphQL type is checked against its view: the same
fields, under the view's public name, and nothing filled in by GraphQL itself (a field
a service leaves out is an error, as on REST, not a silent default)."""

from __future__ import annotations

import warnings

import pydantic
import pytest

from corrallm.api import schemas
from corrallm.config.names import public_name

with warnings.catch_warnings():  # strawberry deprecates the BigInt scalar's form
    warnings.simplefilter("ignore", DeprecationWarning)
    from corrallm.api import graphql


def _definition(cls: type) -> object:
    return cls.__strawberry_definition__  # type: ignore[attr-defined]


def test_every_graphql_type_has_exactly_its_views_fields_under_its_public_name():
    graphql.sdl()  # every type the schema uses is built
    assert graphql._TYPES, "no GraphQL type was derived from a view"
    for view, cls in graphql._TYPES.items():
        definition = _definition(cls)
        fields = {f.python_name for f in definition.fields}  # type: ignore[attr-defined]
        assert fields == set(view.model_fields), view.__name__
        assert definition.name == public_name(view)  # type: ignore[attr-defined]


def test_a_graphql_answer_is_read_as_its_view_and_fills_in_nothing():
    with pytest.raises(pydantic.ValidationError):
        graphql.build(schemas.Logs, {"model": "m", "lines": []})  # n_ctx, n_slots missing
    given = graphql.build(schemas.Logs, {"model": "m", "lines": ["a"], "n_ctx": 8, "n_slots": 2})
    view = schemas.Logs(model="m", lines=["a"], n_ctx=8, n_slots=2)
    assert graphql.build(schemas.Logs, view) == given
