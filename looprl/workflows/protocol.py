"""The Workflow contract and how a user's agent is found.

A workflow is user code, unchanged: anything with `async def run(self, data, **kw)` or
a plain async function `f(data, **kw)`. `kw` holds at least `base_url`, `api_key` and
`model` for an OpenAI client, and `reward_key` (None outside a gateway session). It
returns a reward (float), a dict mapping completion ids (the `id` of the chat
completions it received) to rewards, an EpisodeReward (such a dict and the rollout's
own reward, for multi-turn episodes), or None to reject the rollout. Agents that report
rewards over HTTP return None and POST to `/sessions/{id}/reward` with
`Authorization: Bearer <reward_key>` (the model-call key `api_key` cannot post one). A
workflow that holds resources (processes, connections) may also have `close()`, sync or
async (`Closable`); the run calls it once, at its end.

Owns: the protocols, `resolve_workflow` (instance | class | "module:Name" | async
function) and `close_workflow`. Knows nothing of engines or training.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from looprl.workflows.imports import import_object

if TYPE_CHECKING:  # looprl.types imports torch, which the start-up checks do without
    from looprl.types import EpisodeReward

WorkflowResult: TypeAlias = "float | dict[str, float] | EpisodeReward | None"


@runtime_checkable
class Workflow(Protocol):
    async def run(self, data: dict, **kw: Any) -> WorkflowResult: ...


@runtime_checkable
class Closable(Protocol):
    """A workflow's optional capability: resources to release when the run ends."""

    def close(self) -> Awaitable[None] | None: ...


async def close_workflow(workflow: Workflow) -> None:
    """Release what `workflow` holds: its `close()` (awaited if async), where it is
    `Closable` with a callable close; nothing otherwise."""
    if not (isinstance(workflow, Closable) and callable(workflow.close)):
        return
    if inspect.isawaitable(done := workflow.close()):
        await done


class _FunctionWorkflow:
    """Adapts a plain `async def f(data, **kw)` to the Workflow protocol."""

    def __init__(self, fn: Callable[..., Awaitable[WorkflowResult]]):
        self.fn = fn

    async def run(self, data: dict, **kw: Any) -> WorkflowResult:
        return await self.fn(data, **kw)

    def __repr__(self) -> str:
        return f"workflow function {self.fn.__module__}.{self.fn.__qualname__}"


def resolve_workflow(spec: Any, kwargs: dict[str, Any] | None = None) -> Workflow:
    """Turn an instance, a class, an async function or a "module:Name" into a Workflow.

    A class is instantiated with `kwargs`; for the other forms `kwargs` must be empty.
    Each error names the object's file and line, and what it takes.
    """
    kwargs = kwargs or {}
    if isinstance(spec, str):
        spec = import_object(spec, "workflow.path")
    if inspect.isclass(spec):
        if not inspect.iscoroutinefunction(getattr(spec, "run", None)):
            found = "no run method" if getattr(spec, "run", None) is None else "a plain `def run`"
            raise TypeError(
                f"workflow class {spec.__qualname__} ({_where(spec)}) needs "
                f"`async def run(self, data, **kw)`; it has {found}"
            )
        try:
            return spec(**kwargs)
        except TypeError as e:
            if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
                raise  # raised inside the constructor: the user's own TypeError
            raise TypeError(
                f"cannot build workflow {spec.__qualname__}(**{kwargs}) ({_where(spec)}): {e}; "
                f"it takes {spec.__qualname__}{inspect.signature(spec)} (set workflow.kwargs "
                "to match)"
            ) from e
    if kwargs:
        raise TypeError(f"workflow.kwargs={kwargs} given, but {spec!r} is not a class")
    if inspect.iscoroutinefunction(getattr(spec, "run", None)):
        return spec
    if inspect.iscoroutinefunction(spec):
        return _FunctionWorkflow(spec)
    if inspect.isfunction(spec):
        raise TypeError(
            f"function {spec.__qualname__} ({_where(spec)}) is not a workflow: it is a plain "
            "`def`; make it `async def` (a workflow awaits its model calls)"
        )
    raise TypeError(
        f"{spec!r} is not a workflow: give an object with `async def run(self, data, **kw)`,"
        " a class with one, or an async function"
    )


def _where(obj: Any) -> str:
    """'path/to/file.py:LINE' of a class or function's definition, or its module's name."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return getattr(obj, "__module__", "?")
