import pytest

from looprl.workflows.protocol import resolve_workflow
from looprl.workflows.rlvr import RLVRWorkflow


class CountingWorkflow:
    def __init__(self, bonus: float = 0.0):
        self.bonus = bonus

    async def run(self, data, **kw):
        return 1.0 + self.bonus


async def plain_function(data, **kw):
    return 0.5


async def test_resolves_instance_class_string_and_function():
    instance = CountingWorkflow()
    assert resolve_workflow(instance) is instance
    built = resolve_workflow(CountingWorkflow, {"bonus": 2.0})
    assert await built.run({}) == 3.0
    by_name = resolve_workflow("tests.unit.test_workflow:CountingWorkflow")
    assert isinstance(by_name, CountingWorkflow)
    assert await resolve_workflow(plain_function).run({}) == 0.5
    rlvr = resolve_workflow(
        "looprl.workflows:RLVRWorkflow",
        {"reward_fn": "looprl.tasks.arithmetic:arithmetic_reward"},
    )
    assert isinstance(rlvr, RLVRWorkflow)


def test_bad_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve_workflow("no_such_mod:Agent")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        resolve_workflow("looprl.workflows:Nope")
    with pytest.raises(TypeError, match="not a workflow"):
        resolve_workflow(lambda data: 1.0)
    with pytest.raises(TypeError, match="cannot build workflow CountingWorkflow"):
        resolve_workflow(CountingWorkflow, {"nope": 1})
    with pytest.raises(TypeError, match="is not a class"):
        resolve_workflow(plain_function, {"x": 1})
