"""The whole rules table: every primitive JAX has registered so far -> its rule.

`jaxamp.jaxpr_policy.rules` and `jaxamp.jaxpr_policy.higher_order` key their
tables by the primitive objects of the modules JAX always loads. A few JAX
modules register primitives only when imported (``jax.experimental.sparse``,
Pallas and its backends, ``jax.experimental.rnn``); their rules are listed
by name and resolved here, through the registry, for the modules imported
by the time `autocast` is applied (a primitive can only appear in a program
once its module is imported).
"""

from __future__ import annotations

from collections.abc import Mapping

from jax.extend.core import Primitive

from jaxamp.jaxpr_policy.context import Rule
from jaxamp.jaxpr_policy.higher_order import HIGHER_ORDER_RULES, OPTIONAL_HIGHER_ORDER_RULES
from jaxamp.jaxpr_policy.registry import find
from jaxamp.jaxpr_policy.rules import FIRST_ORDER_RULES, OPTIONAL_RULES


def _resolve(rules_by_name: Mapping[str, Rule]) -> dict[Primitive, Rule]:
    return {primitive: rule for name, rule in rules_by_name.items() for primitive in find(name)}


def rules_table() -> dict[Primitive, Rule]:
    """primitive -> rule, for every primitive with a rule in the JAX modules imported now."""
    return {**FIRST_ORDER_RULES, **_resolve(OPTIONAL_RULES), **higher_order_rules()}


def higher_order_rules() -> dict[Primitive, Rule]:
    """primitive -> rule, for the primitives that carry jaxprs (imported now)."""
    return {**HIGHER_ORDER_RULES, **_resolve(OPTIONAL_HIGHER_ORDER_RULES)}
