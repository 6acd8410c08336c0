"""The rollout wing's shape (issue #39 item 1): nothing in `dapo_mega/rollout/` takes a function
value. A round is read (`async for groups in round`, `round.stop()`, `round.limit_open(n)`),
the dynamic sampler opens rounds on an object (`RoundOpener`), a batch is scored through one
(`Scorer`), and prompts are encoded and decoded through objects (`PromptEncoding`,
`PromptDecoding`): no callback runs back up into the caller, so what the caller does is read in
the caller's own code."""

import ast
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "dapo_mega" / "rollout"
FUNCTION_TYPES = {"Callable", "Awaitable", "Coroutine"}


def _function_aliases(tree: ast.Module) -> set:
    """Module-level names bound to a Callable type (`PromptToInput = Callable[...]`)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(n, ast.Name) and n.id in FUNCTION_TYPES for n in ast.walk(node.value)):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return out


def function_params(source: str, where: str) -> list:
    """`where:line function(param)` of every parameter of `source` that takes a function value:
    annotated with a Callable type or an alias of one, or named as a callback."""
    tree = ast.parse(source)
    banned = FUNCTION_TYPES | _function_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            names = set()
            for n in ast.walk(arg.annotation) if arg.annotation is not None else ():
                if isinstance(n, ast.Name):
                    names.add(n.id)
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    names.update(n.value.replace("[", " ").replace("]", " ").replace(",", " ").split())
            if names & banned or arg.arg.startswith("on_") or arg.arg.endswith(("_fn", "callback")):
                found.append(f"{where}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_function_in_rollout_takes_a_function_value():
    found = [hit for path in sorted(ROLLOUT.glob("*.py")) for hit in function_params(path.read_text(), path.name)]
    assert not found, found


def test_the_check_sees_a_callback():
    """The rule above finds the shapes it forbids: the round's old `on_groups`, an alias of a
    Callable type, a string annotation, a `reward_fn`."""
    source = ("from typing import Callable, Optional\nGen = Callable[..., int]\n"
              "def run(prompts, on_groups, want: Optional[Callable[[], int]], gen: 'Gen', reward_fn): ...\n")
    assert [h.split("(")[1] for h in function_params(source, "x")] == ["on_groups)", "want)", "gen)", "reward_fn)"]
