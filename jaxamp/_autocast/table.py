"""The whole rules table, resolved from names to the running JAX's primitives.

`jaxamp._autocast.rules` and `jaxamp._autocast.higher_order` key
their tables by JAX's primitive names. `rules_table` resolves them through
the registry (`jaxamp._autocast.primitives.find`) when `autocast` is
applied, for the modules imported by then (a primitive can only appear in a
program once its module is imported): a name the running JAX does not
register is absent from the result, so a JAX release that adds or removes
primitives never stops jaxamp from importing or autocast from running.
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.extend.core import Primitive

from jaxamp._autocast.context import Rule
from jaxamp._autocast.higher_order import HIGHER_ORDER_RULES
from jaxamp._autocast.primitives import find
from jaxamp._autocast.rules import FIRST_ORDER_RULES


def resolve(rules_by_name: Mapping[str, Rule]) -> dict[Primitive, Rule]:
    """primitive -> rule, for each name the running JAX registers."""
    return {primitive: rule for name, rule in rules_by_name.items() for primitive in find(name)}


def rules_table() -> dict[Primitive, Rule]:
    """primitive -> rule, for every primitive with a rule in the JAX modules imported now."""
    return resolve({**FIRST_ORDER_RULES, **HIGHER_ORDER_RULES})


def higher_order_rules() -> dict[Primitive, Rule]:
    """primitive -> rule, for the primitives that carry jaxprs (imported now)."""
    return resolve(HIGHER_ORDER_RULES)
