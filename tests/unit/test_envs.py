"""The built-in environments: calculator, guess_number and the python tool (in the reward sandbox).

The pure ones are unit tests; the python tool's run in the sandbox's confined child, marked `workers` as the
python reward's tests are.
"""

from __future__ import annotations

import builtins
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.config.rewards import RewardSandbox
from workers.envs.base import ENVIRONMENTS, Environment, EnvItem, call_argument, env_class, make_env, tools_of
from workers.envs.calculator import Calculator
from workers.envs.guess_number import GuessNumber
from workers.envs.python_tool import PythonTool
from workers.rewards.sandbox.client import RewardFailed, Sandbox

unit = pytest.mark.unit
sandboxed = pytest.mark.workers
ROOT = Path(__file__).resolve().parents[2]


def item(seed: int = 0, **metadata: str | int) -> EnvItem:
    return EnvItem(episode="g/0/0", prompt="p", metadata=dict(metadata), seed=seed)


def tool_call(name: str, **arguments: object) -> str:
    return json.dumps({"name": name, "arguments": arguments})


# --- the shared helper and the registry -----------------------------------------------------------


@unit
@pytest.mark.parametrize(
    ("action", "expected"),
    [
        ("37*45", "37*45"),
        ('{"name": "calculator", "arguments": {"expression": "6*7"}}', "6*7"),
        ('{"name": "calculator", "arguments": "{\\"expression\\": \\"6*7\\"}"}', "6*7"),  # OpenAI's string form
        ('{"name": "guess", "arguments": {"expression": 50}}', "50"),
        ("[1, 2]", "[1, 2]"),  # JSON, but not a call: the raw text
        ('{"a": 1}', '{"a": 1}'),
        ("{not json", "{not json"),
    ],
)
def test_call_argument_reads_json_calls_and_passes_raw_text_through(action, expected):
    assert call_argument(action, "expression") == expected


@unit
@pytest.mark.parametrize(
    ("action", "problem"),
    [
        ('{"name": "calculator", "arguments": {"expr": "1"}}', "the call has no argument 'expression'"),
        ('{"name": "calculator"}', "the call has no argument 'expression'"),
        ('{"name": "calculator", "arguments": [1]}', "the call's arguments are not a JSON object"),
        ('{"name": "calculator", "arguments": "{oops"}', "the call's arguments are not a JSON object"),
        ('{"name": "calculator", "arguments": {"expression": true}}', "is not a string or a number"),
    ],
)
def test_call_argument_refuses_a_call_without_its_argument(action, problem):
    with pytest.raises(ValueError, match=problem):
        call_argument(action, "expression")


@unit
@pytest.mark.parametrize("spec", ["calculator", "guess_number"])
def test_the_pure_builtins_are_registered_under_their_names(spec):
    cls = env_class(spec)
    assert cls.name == spec and cls.deterministic is True
    assert isinstance(make_env(spec), Environment)
    (tool,) = tools_of(cls)
    assert tool["type"] == "function" and tool["function"]["parameters"]["required"], tool


@unit
def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"low \(5\) is above high \(4\)"):
        make_env("guess_number", {"low": 5, "high": 4})
    with pytest.raises(ValueError, match="bad options"):
        make_env("calculator", {"colour": 1})


# --- calculator -------------------------------------------------------------------------------------


@unit
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*45", "1665"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("2 * (3 + (4 - 1)) / 3", "4"),
        ("-5 + 2", "-3"),
        ("-(2 + 3) * -2", "10"),
        ("--3", "3"),
        ("-2**2", "-4"),  # ** binds tighter than the sign, as in Python
        ("2**3**2", "512"),  # and is right-associative
        ("2**-2", "0.25"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333333333"),
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        ("1.5 * 2", "3"),  # an integer value is written without .0
        (".5 + 1.", "1.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("123456789 * 987654321", "121932631112635269"),  # exact past float's 53 bits
        ("10**18", "1000000000000000000"),
        ("  6 *\t7  ", "42"),
    ],
)
def test_calculator_values(expression, value):
    result = Calculator().step(expression)
    assert (result.observation, result.reward, result.done, result.info) == (value, None, False, {"valid": True})


@unit
@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('true')", "unexpected character '_' at 0"),
        ("1 if 1 else 2", "unexpected character 'i' at 2"),
        ("(1).real", "unexpected character '.' at 3"),
        ("[1][0]", "unexpected character '[' at 0"),
        ("1e5", "unexpected character 'e' at 1"),
        ("1/0", "division by zero"),
        ("5 % (2 - 2)", "division by zero"),
        ("3 // 0", "division by zero"),
        ("0**-1", "division by zero"),
        ("10**19", "a value larger than 1000000000000000000"),
        ("9" * 19, "a value larger than 1000000000000000000"),
        ("10**18 * 10 / 10", "a value larger than 1000000000000000000"),  # every intermediate value is bounded
        ("2**65", "an exponent must be an integer of at most 64"),
        ("2**0.5", "an exponent must be an integer of at most 64"),
        ("1+" * 100 + "1", "longer than 200 characters"),
        ("(" * 40 + "1" + ")" * 40, "nested more than 32 deep"),
        ("-" * 40 + "1", "nested more than 32 deep"),
        ("((1)", "unbalanced parentheses"),
        ("1)", "unexpected ')'"),
        ("3 4", "unexpected '4'"),
        ("1 +", "the expression ends too early"),
        ("", "empty expression"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, problem):
    result = Calculator().step(expression)
    assert result.observation.startswith("error: ") and problem in result.observation, result.observation
    assert (result.reward, result.done, result.info) == (None, False, {"valid": False})


@unit
def test_calculator_never_evaluates_python(monkeypatch):
    """With eval, exec and compile unusable the calculator computes as before: it never calls them."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the calculator ran Python")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert Calculator().step("(1 + 2) * -3").observation == "-9"
    assert Calculator().step("__import__('os')").info == {"valid": False}


@unit
def test_calculator_takes_the_json_call_and_its_options():
    calculator = Calculator(max_length=10, max_value=1000)
    assert calculator.reset(item()) == ""
    assert calculator.step(tool_call("calculator", expression="6*7")).observation == "42"
    assert calculator.step(tool_call("calculator", expr="6*7")).observation == (
        "error: the call has no argument 'expression'"
    )
    assert calculator.step("999 + 2").observation == "error: a value larger than 1000"
    assert calculator.step("1+1+1+1+1+1").observation == "error: the expression is longer than 10 characters"


# --- guess_number -----------------------------------------------------------------------------------


def bisect(env: GuessNumber, low: int, high: int) -> list[tuple[int, str, float | None, bool]]:
    """Play by bisection until the episode ends: (guess, observation, reward, done) per step."""
    steps = []
    while True:
        guess = (low + high) // 2
        result = env.step(str(guess))
        steps.append((guess, result.observation, result.reward, result.done))
        if result.done:
            return steps
        if result.observation == "higher":
            low = guess + 1
        else:
            assert result.observation == "lower", result
            high = guess - 1


@unit
def test_guess_number_is_found_by_bisection():
    env = GuessNumber()
    assert env.reset(item(secret=37)) == "guess a number in 1..100"
    steps = bisect(env, 1, 100)
    assert [s[:2] for s in steps] == [(50, "lower"), (25, "higher"), (37, "correct")]
    assert [s[2:] for s in steps] == [(None, False), (None, False), (1.0, True)]


@unit
def test_guess_number_draws_its_secret_from_the_seed():
    def episode(seed: int) -> list[tuple[int, str, float | None, bool]]:
        env = GuessNumber(low=1, high=1000, max_guesses=20)
        env.reset(item(seed=seed))
        return bisect(env, 1, 1000)

    first = episode(7)
    assert first == episode(7)
    assert first[-1][1:] == ("correct", 1.0, True) and len(first) <= 10  # log2(1000) guesses at most
    assert len({episode(seed)[-1][0] for seed in range(10)}) > 1, "every seed drew the same secret"


@unit
def test_guess_number_ends_with_reward_0_after_max_guesses():
    env = GuessNumber(max_guesses=3)
    env.reset(item(secret=100))
    results = [env.step(guess) for guess in ("1", "2", "3")]
    assert [(r.observation, r.reward, r.done) for r in results] == [
        ("higher", None, False),
        ("higher", None, False),
        ("higher; no guesses left, it was 100", 0.0, True),
    ]
    assert results[-1].info == {"valid": True, "guesses": 3}
    after = env.step("100")
    assert (after.observation, after.reward, after.done) == ("error: the game is over", None, True)


@unit
def test_guess_number_says_a_non_integer_is_not_a_guess():
    env = GuessNumber(max_guesses=1)
    env.reset(item(secret=5))
    for action in ("five", "5.5", "", tool_call("guess", number=5)):
        result = env.step(action)
        assert result.observation.startswith("error: ") and (result.reward, result.done) == (None, False), result
        assert result.info == {"valid": False}
    result = env.step(tool_call("guess", guess=5))  # the JSON call, with the integer JSON schema asks for
    assert (result.observation, result.reward, result.done) == ("correct", 1.0, True)


@unit
def test_guess_number_refuses_a_secret_out_of_range():
    with pytest.raises(ValueError, match=r"the secret 0 is not in 1\.\.100"):
        GuessNumber().reset(item(secret=0))
    with pytest.raises(ValueError, match="is not an integer"):
        GuessNumber().reset(item(secret="forty"))


# --- python, in the reward sandbox --------------------------------------------------------------------


@pytest.fixture
def python() -> Iterator[PythonTool]:
    env = PythonTool(timeout_s=2.0, max_output_chars=100)
    yield env
    env.close()


@sandboxed
def test_python_returns_what_the_program_printed(python):
    assert python.reset(item()) == ""
    result = python.step("for i in range(3):\n    print(i * i)")
    assert (result.observation, result.reward, result.done) == ("0\n1\n4\n", None, False)
    assert result.info == {"valid": True, "timed_out": False, "cut": False}
    assert python.step(tool_call("python", code="print(6 * 7)")).observation == "42\n"
    assert python.step(tool_call("python", program="1")).info == {"valid": False}


@sandboxed
def test_python_gives_the_errors_last_line_after_the_output(python):
    assert python.step("print('before')\nx = 1 / 0").observation == "before\nZeroDivisionError: division by zero"
    assert python.step("import no_such_module").observation == "ModuleNotFoundError: No module named 'no_such_module'"
    assert python.step("import sys\nsys.exit(3)").observation == "SystemExit: 3"
    result = python.step("def f(:\n    pass")
    assert (result.observation, result.info["valid"]) == ("SyntaxError: invalid syntax", False)


@sandboxed
def test_python_cuts_long_output(python):
    result = python.step("print('x' * 1000)")
    assert result.observation == "x" * 100 and result.info["cut"] is True


@sandboxed
def test_python_stops_a_program_at_its_deadline_and_runs_the_next(python):
    pid = python._sandbox.pid
    result = python.step("while True:\n    pass")
    assert result.observation == "TimeoutError: the program ran longer than 2s" and result.info["timed_out"] is True
    assert python.step("print('next')").observation == "next\n"
    assert python._sandbox.pid == pid, "the deadline cost the sandbox, not only the program"


@sandboxed
def test_python_programs_share_no_state(python):
    assert python.step("import builtins\nbuiltins.print = None\nx = 5").observation == ""
    assert python.step("print(globals().get('x'))").observation == "None\n"
    assert python.step("import os\nos._exit(0)").observation == "the program exited with code 0 before it finished"
    assert python.step("print('fine')").observation == "fine\n"


@sandboxed
def test_python_reaches_no_credentials_network_or_outside_file(python, monkeypatch, tmp_path):
    """A hostile program: the worker's bus password, a port on 127.0.0.1 and a file of the worker's, all
    reachable from the worker itself, are out of its reach."""
    monkeypatch.setenv("RELAX_PASSWORD", "s3cret")
    secret = tmp_path / "admin.env"
    secret.write_text("RELAX_PASSWORD=s3cret\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from here
        env = PythonTool(timeout_s=5.0)  # started with the password in the worker's environment
        try:
            program = (
                "import os, socket\n"
                "print('env', os.environ.get('RELAX_PASSWORD'))\n"
                "try:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    print('network open')\n"
                "except OSError as err:\n"
                "    print('network', type(err).__name__)\n"
                "try:\n"
                f"    print('file', open({str(secret)!r}).read())\n"
                "except OSError as err:\n"
                "    print('file', type(err).__name__)\n"
            )
            result = env.step(program)
        finally:
            env.close()
    assert result.observation == "env None\nnetwork OSError\nfile FileNotFoundError\n", result.observation


REFUSED = """
import json, sys
from relax_bus.log import configure
from tests.security.test_reward_sandbox import refuse_unshare
configure("warning")
refuse_unshare()  # as the container runtimes' default seccomp profiles do
from workers.envs.python_tool import PythonTool
from workers.rewards.sandbox.client import RewardFailed, Sandbox
from workers.config.rewards import RewardSandbox
try:
    env = PythonTool(sandbox=json.loads(sys.argv[1]))
except ValueError as err:
    print(json.dumps({"refused": str(err)}))
else:
    print(json.dumps({"observation": env.step("print(6 * 7)").observation}))
    env.close()
"""


def without_unshare(sandbox: object) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", REFUSED, json.dumps(sandbox)],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@sandboxed
def test_python_refuses_to_start_without_isolation_unless_waived():
    refused = without_unshare("required")["refused"]
    assert "\n" not in refused and refused.startswith("the environment sandbox cannot isolate user code"), refused
    assert "namespaces refused" in refused and "`sandbox: unisolated` on the environment" in refused, refused
    assert without_unshare("unisolated") == {"observation": "42\n"}


@sandboxed
def test_python_is_registered_and_checks_its_options():
    cls = env_class("python")
    assert (cls.name, cls.deterministic, ENVIRONMENTS["python"]) == (
        "python",
        True,
        "workers.envs.python_tool:PythonTool",
    )
    assert tools_of(cls)[0]["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(ValueError, match="give the memory limit once"):
        PythonTool(sandbox={"memory_mb": 256})
    with pytest.raises(ValueError, match="sandbox must be required, unisolated or a mapping"):
        PythonTool(sandbox="loose")
    with pytest.raises(ValueError, match="bad sandbox options: cpu_s"):
        PythonTool(sandbox={"cpu_s": 0})
    env = make_env("python", {"memory_mb": 256, "sandbox": {"processes": 16}})
    try:
        assert isinstance(env, PythonTool) and env.settings.memory_mb == 256 and env.settings.processes == 16
        assert env._sandbox.info["limits"]["RLIMIT_AS"] == 256 << 20, env._sandbox.info
    finally:
        env.close()


@sandboxed
def test_call_json_carries_any_json_value_and_refuses_the_rest():
    """The sandbox's reply channel, extended for tools: a JSON value comes back as it is; what JSON cannot
    carry is the function's error, and the sandbox answers the next call."""
    ref = "tests.workers.reward_fns:tool_value"
    sandbox = Sandbox([(ref, {})], RewardSandbox())
    try:
        sandbox.start()
        assert sandbox.call_json(ref, "list", {}, 10.0) == [1, "a", None, {"b": True}]
        with pytest.raises(RewardFailed, match="TypeError: Object of type set is not JSON serializable"):
            sandbox.call_json(ref, "set", {}, 10.0)
        with pytest.raises(RewardFailed, match="ValueError: Out of range float values are not JSON compliant"):
            sandbox.call_json(ref, "nan", {}, 10.0)
        with pytest.raises(RewardFailed, match="TypeError: reward function returned list, expected a float"):
            sandbox.call(ref, "list", None, "stop", {}, 10.0)  # a reward still must be a float
        assert sandbox.call_json(ref, "list", {}, 10.0)[1] == "a"
    finally:
        sandbox.stop()
