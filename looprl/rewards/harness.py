"""The harness: the first Python that runs in a box, as the box's user. It is sent to the
box's interpreter as `-c` text by looprl/rewards/sandbox.py; the verdict on what it
writes back is made outside the box (looprl/rewards/cases.py).

Owns: what runs inside the box around the program. Not the box, not the verdict.
"""

# The harness runs first in the box, as the box's user: it reads the task (the fd in
# argv[1]), caps the box's processes, says it started on the pipe in argv[2] and closes
# it, then runs the program; results go on the pipe in argv[3].
# With a script (a test's statements), it runs the script after the program in the same
# scope; the script calls __looprl_emit__(site, *leaves) for each value a test asks for,
# which writes the values as plain, tagged JSON. Without a script (a stdin/stdout case),
# the results pipe is closed before the program runs: its stdout is the answer.
HARNESS = r"""
import json, os, resource, sys

def _encode(value):
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_encode(v) for v in value]
    if kind is tuple:
        return {"$tuple": [_encode(v) for v in value]}
    if kind in (set, frozenset):
        return {"$" + kind.__name__: [_encode(v) for v in value]}
    if kind is dict:
        return {"$dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if kind is bytes:
        return {"$bytes": value.hex()}
    raise TypeError(f"a {kind.__name__} is not plain data (None, bool, int, float, str, "
                    "bytes, list, tuple, set, frozenset, dict)")

def _main():
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        task = json.loads(f.read())
    cap = task["max_processes"]
    if cap:
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    os.write(int(sys.argv[2]), b"started\n")
    os.close(int(sys.argv[2]))
    results = os.fdopen(int(sys.argv[3]), "w")
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    if task["script"] is None:
        results.close()
        exec(compile(task["program"], "program.py", "exec"), scope)
        return

    def emit(site, *leaves):
        values = []
        for leaf in leaves:
            try:
                values.append({"value": _encode(leaf())})
            except Exception as e:
                values.append({"error": f"{type(e).__name__}: {e}"[:300]})
        results.write(json.dumps({"site": site, "values": values}) + "\n")
        results.flush()

    sys.stdin = open(os.devnull)
    exec(compile(task["program"], "program.py", "exec"), scope)
    scope["__looprl_emit__"] = emit
    exec(compile(task["script"], "test.py", "exec"), scope)
    results.write('{"done": true}\n')
    results.flush()

_main()
"""
