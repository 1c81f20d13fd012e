"""Workflows: the user's agent code as looprl runs it, and looprl's own.

- protocol.py: the `Workflow` contract (`async def run(self, data, **kw)`), the optional
  `Closable`, `resolve_workflow` (instance | class | "module:Name" | async function) and
  `close_workflow`;
- imports.py: `import_object`, the one way a `module:Name` string becomes an object;
- client.py: `session_client`, the OpenAI client looprl's workflows call a session with;
- rlvr.py: `RLVRWorkflow`, one chat turn scored by the configured reward (the default);
- agent_process.py: `AgentProcess`, an agent program per rollout (workflow.mode=subprocess);
- env.py: `EnvWorkflow`, which plays any environment (env.name) turn by turn;
- verifiers.py: `VerifiersWorkflow`, a verifiers environment's own rollouts and rubric;
- resolution.py: `configured_workflow`, the workflow the config names.

The names are imported on first use: an env worker process imports `import_object`
without the openai client, and `looprl.workflows:RLVRWorkflow` (a workflow.path) reads
as the class.
"""

__all__ = [
    "AgentProcess",
    "Closable",
    "EnvWorkflow",
    "RLVRWorkflow",
    "VerifiersWorkflow",
    "Workflow",
    "close_workflow",
    "configured_workflow",
    "resolve_workflow",
]

_WHERE = {
    "AgentProcess": "looprl.workflows.agent_process",
    "Closable": "looprl.workflows.protocol",
    "EnvWorkflow": "looprl.workflows.env",
    "RLVRWorkflow": "looprl.workflows.rlvr",
    "VerifiersWorkflow": "looprl.workflows.verifiers",
    "Workflow": "looprl.workflows.protocol",
    "close_workflow": "looprl.workflows.protocol",
    "configured_workflow": "looprl.workflows.resolution",
    "resolve_workflow": "looprl.workflows.protocol",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'looprl.workflows' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
