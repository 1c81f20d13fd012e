"""The harness: the first Python that runs in a box, as the box's user. It is sent to the
box's interpreter as `-c` text by looprl/rewards/sandbox.py; the verdict on what it
writes back is made outside the box (looprl/rewards/cases.py).

Owns: what runs inside the box around the program or the test. Not the box, not the
verdict.
"""

# The harness runs first in the box, as the box's user: it reads the task (the fd in
# argv[1]), caps the box's processes, says it started on the pipe in argv[2] and closes
# it, then runs; results go on the pipe in argv[3]. Three modes:
# - the program's box (a script, no data): the program, then the script in its scope.
#   The script calls __looprl_emit__(site, *leaves) for each assert; each leaf's value
#   is written as plain, tagged JSON ({"value": ...}), or {"error": ...} if it raised,
#   or {"opaque": ...} if it is not plain data (a failure only where the judge reads it).
# - the judge box (a script and data: the program's values as JSON text): the test's
#   own script alone; __looprl_value__(site, i) decodes a leaf's value when the assert
#   reads it (raising for an error or an opaque one, so `or`/`and` short-circuit as in
#   Python), and __looprl_verdict__(site, check) writes whether the check held.
# - a stdin/stdout case (no script): the results pipe is closed before the program
#   runs; its stdout is the answer.
# Both scripted modes write {"done": true} when the script ran to its end.
HARNESS = r"""
import json, os, resource, sys
from collections.abc import Iterator

# The builtins the encoder uses, bound here before the program can replace them (a
# patched isinstance would otherwise report a float as an int).
isinstance, int, float, complex, str, bytes, bytearray = (
    isinstance, int, float, complex, str, bytes, bytearray)
list, tuple, set, frozenset, dict, hex, repr, type, Exception = (
    list, tuple, set, frozenset, dict, hex, repr, type, Exception)

_DEEPEST = 100  # nesting levels of a value sent back
_HEX_BITS = 13_000  # ints longer than this (~3,900 digits) travel as hex

class _Opaque(Exception):
    pass

def _encode(value, depth=0):
    if depth > _DEEPEST:
        raise _Opaque(f"value nested deeper than {_DEEPEST} levels")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        value = int(value)
        return {"$int": hex(value)} if value.bit_length() > _HEX_BITS else value
    if isinstance(value, float):
        value = float(value)
        return value if value - value == 0 else {"$float": repr(value)}
    if isinstance(value, complex):
        return {"$complex": [_encode(value.real, depth + 1), _encode(value.imag, depth + 1)]}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bytes | bytearray):
        return {"$bytes": bytes(value).hex()}
    items = lambda values: [_encode(v, depth + 1) for v in values]
    if isinstance(value, list):
        return items(list(value))
    if isinstance(value, tuple):
        return {"$tuple": items(tuple(value))}
    if isinstance(value, frozenset):
        return {"$frozenset": items(value)}
    if isinstance(value, set):
        return {"$set": items(value)}
    if isinstance(value, dict):
        return {"$dict": [items(pair) for pair in dict.items(value)]}
    if isinstance(value, Iterator):  # a generator, map, zip...: what it yields
        return {"$iter": items(value)}
    raise _Opaque(type(value).__name__)

def _decode(data):
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [_decode(v) for v in data]
    if kind is dict and len(data) == 1:
        (tag, items), = data.items()
        if tag == "$int" and type(items) is str:
            return int(items, 16)
        if tag == "$float" and items in ("nan", "inf", "-inf"):
            return float(items)
        if tag == "$bytes" and type(items) is str:
            return bytes.fromhex(items)
        if type(items) is list:
            values = [_decode(v) for v in items]
            numbers = all(type(v) in (int, float) for v in values)
            if tag == "$complex" and len(values) == 2 and numbers:
                return complex(*values)
            if tag == "$tuple":
                return tuple(values)
            if tag == "$set":
                return set(values)
            if tag == "$frozenset":
                return frozenset(values)
            if tag == "$iter":
                return iter(values)
            if tag == "$dict" and all(type(p) is list and len(p) == 2 for p in values):
                return dict(values)
    raise ValueError(f"not a value the program's box encodes: {str(data)[:100]}")

class ProgramFailed(Exception):
    "A value the program did not give: it raised, or it is not plain data."

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

    def write(record):
        results.write(json.dumps(record) + "\n")
        results.flush()

    def emit(site, *leaves):
        values = []
        for leaf in leaves:
            try:
                value = leaf()
            except Exception as e:
                values.append({"error": f"{type(e).__name__}: {e}"[:300]})
                continue
            try:
                values.append({"value": _encode(value)})
            except Exception as e:
                values.append({"opaque": f"{type(value).__name__} ({e})"[:300]})
        write({"site": site, "values": values})

    def value(site, index):
        entry = data[site][index]
        if "value" in entry:
            return _decode(entry["value"])
        if "error" in entry:
            raise ProgramFailed(f"the program raised {entry['error']}")
        raise ProgramFailed(f"the program's value is not plain data: {entry['opaque']}")

    def verdict(site, check):
        try:
            passed, why = bool(check()), "is false"
        except Exception as e:
            passed, why = False, f"raised {type(e).__name__}: {e}"[:300]
        write({"site": site, "passed": passed, "why": "" if passed else why})

    sys.stdin = open(os.devnull)
    if task.get("data") is None:
        exec(compile(task["program"], "program.py", "exec"), scope)
        scope["__looprl_emit__"] = emit
    else:
        data = json.loads(task["data"])
        scope["__looprl_value__"], scope["__looprl_verdict__"] = value, verdict
    exec(compile(task["script"], "test.py", "exec"), scope)
    write({"done": True})

_main()
"""
