"""The hostile-reward suite: programs written to game `CodeReward.score`, each scored
through it, and what they left behind.

Two kinds of trick. *Verdict* tricks attack the judging (an `__eq__` that is always
true, a replaced `compile`, forged results, exiting early, ...) against the tests
`f(2) == 4` and `f(5) == 10`, with a wrong `f` underneath: each must score 0 in every
mode, since the verdict is made outside the program. `OWN_TEST_TRICKS` attack the
judging of tests of their own (patching what the expected side uses, reading the test's
setup, mutating their inputs, sending back values meant to break the judge), each with
an honest program that must score 1. *Isolation* tricks try to reach
something outside the box that holds a secret number (a 0600 file of this user, this
process's environment, a loopback TCP server, owner-only and abstract Unix sockets,
/etc/shadow) and return it, against the test `f(2) == SECRET`: a trick that scores 1
got out.

Run as `python -m tests.support.hostile ISOLATION` (from the repository root, as any
user); it prints one JSON object: {"scores": {trick: score}, "honest": {own-test trick: the
honest program's score}, "survivors": [...],
"written_outside": [...], "skipped": {trick: why}}.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

from looprl.config import CodeRewardConfig
from looprl.rewards.code import CodeReward

LIMITS = dict(timeout_s=4.0, cpu_time_s=1, memory_mb=256, max_processes=16, disk_mb=16)
TESTS = ["assert f(2) == 4\nassert f(5) == 10"]  # one test, one box per trick
WRONG = "def f(x):\n    return 3\n"
MARKER = "987.654"  # the survivors' sleep, found by it in /proc afterwards

VERDICT_TRICKS = {
    "an object whose __eq__ is always true": (
        "class Equal:\n    def __eq__(self, other): return True\n"
        "    def __ne__(self, other): return False\n    __hash__ = object.__hash__\n"
        "def f(x):\n    return Equal()\n"
    ),
    "an int subclass that equals anything": (
        "class Int(int):\n    def __eq__(self, other): return True\ndef f(x):\n    return Int(3)\n"
    ),
    "builtins.compile and exec replaced": (
        "import builtins\n_code = (lambda: None).__code__\n"
        "builtins.compile = lambda *a, **k: _code\nbuiltins.exec = lambda *a, **k: None\n" + WRONG
    ),
    "json.dumps replaced to report passes": (
        "import json\n_dumps = json.dumps\n"
        "def dumps(o, *a, **k):\n"
        "    if isinstance(o, dict) and 'values' in o:\n"
        "        o = {'site': o['site'], 'values': [{'value': True}] * len(o['values'])}\n"
        "    return _dumps(o, *a, **k)\n"
        "json.dumps = dumps\n" + WRONG
    ),
    "forged results from the harness's frames": (
        "import os, sys\n"
        "def f(x):\n"
        "    frame = sys._getframe(1)\n"
        "    while frame is not None:\n"
        "        out = frame.f_locals.get('results') or frame.f_globals.get('results')\n"
        "        if hasattr(out, 'write'):\n"
        "            for site in range(8):\n"
        '                out.write(\'{"site": %d, "values": [{"value": true}]}\\n\' % site)\n'
        "            out.write('{\"done\": true}\\n')\n"
        "            out.flush()\n"
        "            os._exit(0)\n"
        "        frame = frame.f_back\n"
        "    return 3\n"
    ),
    "sys.exit(0) before the test": "import sys\nsys.exit(0)\n",
    "os._exit(0) before the test": "import os\nos._exit(0)\n",
    "stdout and stderr truncated": (
        "import os\nos.ftruncate(1, 0)\nos.ftruncate(2, 0)\n"
        "for fd in range(3, 64):\n    try:\n        os.ftruncate(fd, 0)\n"
        "    except OSError:\n        pass\n" + WRONG
    ),
    "SIGKILL to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "signal handlers ignored, then a busy loop": (
        "import signal\nfor s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGALRM, signal.SIGINT):\n"
        "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n"
    ),
    "reads the test from disk and fds": (
        "import os, re\n"
        "def f(x):\n"
        "    found = []\n"
        "    places = ['/proc/self/cmdline', '/proc/1/cmdline', '/proc/self/environ']\n"
        "    places += ['/proc/self/fd/' + n for n in os.listdir('/proc/self/fd')]\n"
        "    for top in ('/work', '/tmp', '/', '/proc/self/cwd'):\n"
        "        for name in os.listdir(top):\n"
        "            places.append(os.path.join(top, name))\n"
        "    for place in places:\n"
        "        try:\n"
        "            with open(place, 'rb') as fh:\n"
        "                found += re.findall(rb'f\\(%d\\) == (\\d+)' % x, fh.read(1 << 20))\n"
        "        except OSError:\n"
        "            pass\n"
        "    return int(found[0]) if found else 3\n"
    ),
    "drains every pipe it can open": (
        "import os\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        fds = os.listdir(f'/proc/{pid}/fd')\n"
        "    except OSError:\n"
        "        continue\n"
        "    for fd in fds:\n"
        "        try:\n"
        "            if 'pipe' in os.readlink(f'/proc/{pid}/fd/{fd}'):\n"
        "                r = os.open(f'/proc/{pid}/fd/{fd}', os.O_RDONLY | os.O_NONBLOCK)\n"
        "                os.read(r, 65536)\n"
        "        except OSError:\n"
        "            pass\n" + WRONG
    ),
    "writes the expected output to files": (
        "for name in ('expected.txt', 'output.txt', 'result.json', '/tmp/result'):\n"
        "    open(name, 'w').write('4\\n10\\n{\"passed\": true}')\n" + WRONG
    ),
    "leaves a survivor (setsid, double fork)": (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{MARKER}'])\n"
        "    os._exit(0)\n" + WRONG
    ),
    "a fork bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    ),
    "memory spread over children": (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        block = bytearray(150 * 2**20)\n"
        "        block[::4096] = b'1' * len(block[::4096])\n"
        "        time.sleep(10)\n"
        "        os._exit(0)\n"
        "time.sleep(10)\n" + WRONG
    ),
}


# Tricks against the judging of tests of their own: each is (program, tests, an honest
# program that must score 1). The wrong program patches what the expected side would
# use, reads the test's setup, mutates what it is given, or sends back values meant to
# break the judge; the expected side and the comparison run in the judge box, so none
# of it scores.
_E = "2.718281828459045"
_FORGE = (
    "import json\n_dumps = json.dumps\n"
    "def dumps(o, *a, **k):\n"
    "    if isinstance(o, dict) and 'values' in o:\n"
    "        return {forged}\n"
    "    return _dumps(o, *a, **k)\n"
    "json.dumps = dumps\ndef f(x):\n    return 3\n"
)
OWN_TEST_TRICKS = {
    # The expected side, computed where the program patched it first.
    "math.exp patched": (
        "import math\nmath.exp = lambda x: 0.0\ndef f(x):\n    return 0.0\n",
        ["import math\nassert math.isclose(f(1.0), math.exp(1.0))"],
        "import math\ndef f(x):\n    return math.exp(x)\n",
    ),
    "math.factorial patched": (
        "import math\nmath.factorial = lambda n: 0\ndef f(n):\n    return 0\n",
        ["import math\nassert abs(f(4) - math.factorial(4)) < 1e-9"],
        "def f(n):\n    return 1 if n < 2 else n * f(n - 1)\n",
    ),
    "builtins.all patched under the test's predicate": (
        "import builtins\nbuiltins.all = lambda xs: True\ndef my_sort(xs):\n    return xs\n",
        [
            "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n"
            "assert is_sorted(my_sort([3, 1, 2]))"
        ],
        "def my_sort(xs):\n    return sorted(xs)\n",
    ),
    "isinstance patched": (
        "import builtins\n_isinstance = isinstance\n"
        "builtins.isinstance = lambda o, t: t is int or _isinstance(o, t)\n"
        "def f(x):\n    return 4.0\n",
        ["assert isinstance(f(2), int) and f(2) == 4"],
        "def f(x):\n    return 2 * x\n",
    ),
    "returns the test's reference function": (
        "def f(x):\n    return ref(x)\n",
        ["def ref(x):\n    return x * x + 1\nassert abs(f(2) - ref(2)) < 1e-9"],
        "def f(x):\n    return x * x + 1\n",
    ),
    "operator.mul patched for functools.reduce": (
        "import operator\noperator.mul = lambda a, b: 0\ndef f(n):\n    return 0\n",
        [
            "import operator\nfrom functools import reduce\n"
            "assert f(4) == reduce(operator.mul, [1, 2, 3, 4])"
        ],
        "def f(n):\n    return 1 if n < 2 else n * f(n - 1)\n",
    ),
    "functools.reduce patched": (
        "import functools\nfunctools.reduce = lambda *a: 7\ndef f(xs):\n    return 7\n",
        [
            "import functools\n"
            "assert f([1, 2, 3]) == functools.reduce(lambda a, b: a + b, [1, 2, 3])"
        ],
        "def f(xs):\n    return sum(xs)\n",
    ),
    "collections.Counter patched": (
        "import collections\nclass C(dict):\n    def __eq__(self, other):\n        return True\n"
        "collections.Counter = C\ndef f(s):\n    return 'zz'\n",
        [
            "from collections import Counter\n"
            "assert Counter(f('abca')) == Counter({'a': 2, 'b': 1, 'c': 1})"
        ],
        "def f(s):\n    return s\n",
    ),
    "sorted patched, used by the test's helper": (
        "import builtins\nbuiltins.sorted = lambda xs, **k: [1, 2]\n"
        "def f(xs):\n    return [9, 9]\n",
        ["def same(a, b):\n    return sorted(a) == sorted(b)\nassert same(f([2, 1]), [1, 2])"],
        "def f(xs):\n    return xs[::-1]\n",
    ),
    "a stdlib module name shadowed": (
        "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n"
        "def f(x):\n    return 0.0\n",
        [f"assert math.isclose(f(1.0), {_E})"],
        f"def f(x):\n    return {_E}\n",
    ),
    "sys.modules poisoned": (
        "import sys, types\nfake = types.ModuleType('math')\n"
        "fake.isclose = lambda *a, **k: True\nsys.modules['math'] = fake\n"
        "def f(x):\n    return 0.0\n",
        [f"import math\nassert math.isclose(f(1.0), {_E})"],
        f"def f(x):\n    return {_E}\n",
    ),
    # Objects that would lie where compared: only their data leaves the box.
    "a str subclass whose __eq__ is always true": (
        "class S(str):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = str.__hash__\ndef f(s):\n    return S('zz')\n",
        ["assert f('ab') == 'ba'"],
        "def f(s):\n    return s[::-1]\n",
    ),
    "a float subclass that is less than anything": (
        "class F(float):\n    def __lt__(self, other):\n        return True\n"
        "    def __sub__(self, other):\n        return F(0)\n"
        "    def __abs__(self):\n        return F(0)\n"
        "def f(x):\n    return F(9.0)\n",
        ["assert abs(f(2) - 1.5) < 1e-9"],
        "def f(x):\n    return 0.75 * x\n",
    ),
    # The test's setup, read from the program's scope.
    "reads the test's expected value": (
        "def f(x):\n    return expected\n",
        ["expected = 918273\nassert f(2) == expected"],
        "def f(x):\n    return 918273\n",
    ),
    "reads a local of HumanEval's check": (
        "def f(n):\n    return want\n",
        [
            "def check(candidate):\n    want = [1, 2, 3]\n    assert candidate(3) == want\n\n"
            "check(f)\n"
        ],
        "def f(n):\n    return list(range(1, n + 1))\n",
    ),
    "reads __main__'s globals and its caller's frame": (
        "import sys\ndef f(x):\n    main = vars(sys.modules['__main__'])\n"
        "    found = main.get('answer', sys._getframe(1).f_globals.get('answer'))\n"
        "    return found if found is not None else 0\n",
        ["answer = 42\nassert f(1) == answer"],
        "def f(x):\n    return 42\n",
    ),
    # What the program is given, changed in place.
    "empties the list it was given": (
        "def total(xs):\n    s = sum(xs)\n    xs.clear()\n    return s\n",
        ["xs = [1, 2, 3]\nassert total(xs) == 6\nassert xs == [1, 2, 3]"],
        "def total(xs):\n    return sum(xs)\n",
    ),
    "sorts the test's list in place and returns it": (
        "def f(xs):\n    xs.sort()\n    return xs\n",
        ["xs = [3, 1, 2]\nassert f(xs) == [1, 2, 3]\nassert xs == [3, 1, 2]"],
        "def f(xs):\n    return sorted(xs)\n",
    ),
    # Values meant to break the judge or the trainer.
    "a format string that explodes in the judge": (
        "def f(x):\n    return '%02000000000d'\n",
        ["assert f(3) % 2 == 1"],
        "def f(x):\n    return x\n",
    ),
    "a huge value sent back": (
        "def f(x):\n    return 'x' * (4 << 20)\n",
        ["assert f(3) == 3"],
        "def f(x):\n    return x\n",
    ),
    "a deeply nested record forged": (
        _FORGE.format(
            forged="'{\"site\": 0, \"values\": [{\"value\": ' + '[' * 100000 + ']' * 100000 + '}]}'"
        ),
        ["assert f(3) == [1]"],
        "def f(x):\n    return [1]\n",
    ),
    "a generator that never ends": (
        "def f(x):\n    while True:\n        yield 1\n",
        ["assert list(f(3)) == [1, 1, 1]"],
        "def f(x):\n    yield from [1] * x\n",
    ),
    "forges the judge's verdict records": (
        _FORGE.format(forged='\'{"site": 0, "passed": true, "why": ""}\\n{"done": true}\''),
        ["assert f(3) == 6"],
        "def f(x):\n    return 2 * x\n",
    ),
}


def isolation_tricks(secret: int, places: dict) -> dict[str, str]:
    """Programs that return `secret` if they can reach where it is kept."""
    leak = "def f(x):\n    try:\n{body}\n    except Exception:\n        return 0\n"

    def program(body: str) -> str:
        return leak.format(body="\n".join("        " + line for line in body.splitlines()))

    def over_socket(family: str, address: str) -> str:
        return program(
            f"import socket\ns = socket.socket({family})\ns.settimeout(2)\n"
            f"s.connect({address})\nreturn int(s.recv(64))"
        )

    return {
        "reads a 0600 file of this user": program(
            f"return int(open({str(places['file'])!r}).read())"
        ),
        "reads the trainer's environment from /proc": program(
            f"text = open('/proc/{os.getpid()}/environ', 'rb').read()\n"
            "return int(text.split(b'LOOPRL_HOSTILE_SECRET=')[1].split(b'\\0')[0])"
        ),
        "reads its own environment": program(
            "import os\nreturn int(os.environ['LOOPRL_HOSTILE_SECRET'])"
        ),
        "connects to a loopback TCP server": over_socket(
            "socket.AF_INET", repr(("127.0.0.1", places["port"]))
        ),
        "connects to an owner-only Unix socket": over_socket(
            "socket.AF_UNIX", repr(str(places["unix"]))
        ),
        "connects to an abstract Unix socket": over_socket(
            "socket.AF_UNIX", repr(places["abstract"])
        ),
        "reads /etc/shadow": program(f"open('/etc/shadow').read()\nreturn {secret}"),
        "writes to /tmp and /dev/shm outside": program(
            "import os\nfor d in ('/tmp', '/dev/shm'):\n"
            f"    open(os.path.join(d, 'looprl-hostile-{MARKER}'), 'w').write('x')\nreturn 0"
        ),
    }


class Servers:
    """A TCP server on loopback and two Unix servers that send the secret to whoever
    connects, and a 0600 file holding it."""

    def __init__(self, secret: int):
        self.dir = Path(tempfile.mkdtemp(prefix="looprl-hostile-"))  # 0700
        self.file = self.dir / "secret"
        self.file.write_text(str(secret))
        self.file.chmod(0o600)
        tcp = socket.create_server(("127.0.0.1", 0))
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(self.dir / "socket"))
        os.chmod(self.dir / "socket", 0o600)
        abstract = socket.socket(socket.AF_UNIX)
        self.abstract = f"\0looprl-hostile-{secrets.token_hex(4)}"
        abstract.bind(self.abstract)
        self.sockets = [tcp, unix, abstract]
        self.places = {"file": self.file, "port": tcp.getsockname()[1],
                       "unix": self.dir / "socket", "abstract": self.abstract}  # fmt: skip
        for server in self.sockets:
            server.listen()
            threading.Thread(target=self._serve, args=(server, secret), daemon=True).start()

    @staticmethod
    def _serve(server: socket.socket, secret: int) -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                connection.sendall(str(secret).encode())

    def close(self) -> None:
        for server in self.sockets:
            server.close()
        for path in self.dir.iterdir():
            path.unlink()
        self.dir.rmdir()


def survivors() -> list[str]:
    """Processes left running by the tricks (the survivors' sleep)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if MARKER.encode() in cmdline:
                words = cmdline.replace(bytes(1), b" ").decode().strip()
                found.append(f"{entry}: {words}")
                os.kill(int(entry), signal.SIGKILL)
    return found


async def run_suite(isolation: str) -> dict:
    secret = int(os.environ["LOOPRL_HOSTILE_SECRET"])
    servers = Servers(secret)
    reward = CodeReward(CodeRewardConfig(isolation=isolation, **LIMITS))
    scores, skipped, honest_scores = {}, {}, {}
    try:
        for name, program in VERDICT_TRICKS.items():
            if name == "a fork bomb" and isolation == "unisolated":
                skipped[name] = "not run: unisolated has no process cap (it would bomb here)"
                continue
            scores[name] = await reward.score(f"```python\n{program}```", {"tests": TESTS})
        for name, program in isolation_tricks(secret, servers.places).items():
            row = {"tests": [f"assert f(2) == {secret}"]}
            scores[name] = await reward.score(program, row)
        honest = "def f(x):\n    return 2 * x\n"
        scores["honest (control)"] = await reward.score(honest, {"tests": TESTS})
        for name, (program, tests, right) in OWN_TEST_TRICKS.items():
            scores[name] = await reward.score(program, {"tests": tests})
            honest_scores[name] = await reward.score(right, {"tests": tests})
    finally:
        servers.close()
    outside = [
        str(p)
        for p in (
            Path("/tmp") / f"looprl-hostile-{MARKER}",
            Path("/dev/shm") / f"looprl-hostile-{MARKER}",
        )  # fmt: skip
        if p.exists()
    ]
    for path in outside:
        os.unlink(path)
    stats = reward.take_stats()
    return {"scores": scores, "honest": honest_scores, "survivors": survivors(),
            "written_outside": outside, "skipped": skipped, "stats": stats, "uid": os.getuid(),
            "box": reward.sandbox.describe()}  # fmt: skip


if __name__ == "__main__":
    if "LOOPRL_HOSTILE_SECRET" not in os.environ:  # in the environment /proc shows
        os.environ["LOOPRL_HOSTILE_SECRET"] = str(100_000 + secrets.randbelow(900_000))
        os.execv(sys.executable, [sys.executable, "-m", "tests.support.hostile", *sys.argv[1:]])
    print(json.dumps(asyncio.run(run_suite(sys.argv[1]))))
