"""A request's constraint (response_format, json_schema, grammar) compiled off the event loop:
a schema the engine cannot compile is a 400 naming the field, before anything is queued."""

from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from shardline.api.metrics import ServerMetrics
from shardline.api.schemas import ApiError
from shardline.model.grammar import GrammarError, Grammars, GrammarSpec
from shardline.serving.engine import Constraint

Wanted = tuple[GrammarSpec | Callable[[Grammars], Constraint], str]  # what constrains, and its field


async def constrain(grammars: Grammars | None, wanted: Wanted | None, metrics: ServerMetrics) -> Constraint | None:
    """`wanted`'s constraint: a spec's matcher, or what a callable builds (tools' lazy grammar)."""
    if wanted is None:
        return None
    grammar, param = wanted
    if grammars is None:
        raise ApiError(400, f"{param}: constrained output is not available on this server", param=param,
                       code="unsupported_parameter")
    before = grammars.compile_s
    build = (lambda: grammars.constraint(grammar)) if isinstance(grammar, GrammarSpec) else (lambda: grammar(grammars))
    try:
        constraint = await run_in_threadpool(build)
    except GrammarError as e:
        raise ApiError(400, f"{param}: cannot be compiled into a grammar: {str(e)[:500]}", param=param) from None
    metrics.constrained(grammars.compile_s - before)
    return constraint
