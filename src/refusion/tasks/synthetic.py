"""Synthetic task families a small model trained on one CPU can learn, mirroring the paper's categories.

  arith   multi-step arithmetic word problems with a worked solution ending "#### N"     (math)
  code    a Python function from a one-line specification, scored by hidden tests        (code)
  choice  four-option multiple choice: comparisons, orderings, sums, odd one out          (multiple choice)
  table   long structured outputs: multiplication tables, JSON lists, markdown tables    (structured)

Every example is a pure function of (task, split, seed, index). Train and test are disjoint by
construction: a prompt belongs to the test split iff a stable hash of its text falls in one tenth of
the range, so no test prompt can ever be drawn for training, whatever the seeds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from refusion.tasks import Example, Score, Task
from refusion.tasks.code import sandbox_scorers
from refusion.tasks.common import extract_code, extract_final_number, extract_letter, generated_split, numbers_equal

NAMES = ["Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kai", "Lea", "Max", "Nia",
         "Omar", "Pia", "Raj", "Sam", "Tess", "Uma"]
OBJECTS = ["apples", "pens", "stickers", "coins", "books", "marbles", "cards", "shells", "stamps", "beads"]
LETTERS = "ABCD"


# ----------------------------------------------------------------------------------------------
# arith


def make_arith(rng: random.Random) -> tuple[str, str, int]:
    name, friend = rng.sample(NAMES, 2)
    obj = rng.choice(OBJECTS)
    x = rng.randint(2, 40)
    story, work = [f"{name} has {x} {obj}."], [f"{name} starts with {x} {obj}."]
    for _ in range(rng.randint(2, 4)):
        op = rng.choice(["buy", "give", "double", "boxes"] if x <= 60 else ["give", "give", "buy"])
        if op == "buy":
            b = rng.randint(1, 30)
            story.append(f"Then {name} buys {b} more.")
            work.append(f"After buying {b}: {x} + {b} = {x + b}.")
            x += b
        elif op == "give" and x > 1:
            b = rng.randint(1, x - 1)
            story.append(f"Then {name} gives {b} to {friend}.")
            work.append(f"After giving {b} away: {x} - {b} = {x - b}.")
            x -= b
        elif op == "double":
            story.append(f"Then the number of {obj} doubles.")
            work.append(f"Doubled: {x} x 2 = {2 * x}.")
            x *= 2
        else:
            k, b = rng.randint(2, 5), rng.randint(2, 9)
            story.append(f"Then {name} gets {k} boxes with {b} {obj} in each.")
            work.append(f"The boxes hold {k} x {b} = {k * b}. Now {x} + {k * b} = {x + k * b}.")
            x += k * b
    divisors = [k for k in (2, 3, 4, 5) if x % k == 0 and x // k > 0]
    if divisors and rng.random() < 0.4:
        k = rng.choice(divisors)
        story.append(f"{name} shares them equally among {k} friends. How many {obj} does each friend get?")
        work.append(f"Each friend gets {x} / {k} = {x // k}.")
        x //= k
    else:
        story.append(f"How many {obj} does {name} have now?")
    return " ".join(story), "\n".join(work + [f"#### {x}"]), x


def score_arith(ex: Example, output: str) -> Score:
    got = extract_final_number(output)
    return Score(got, numbers_equal(got, str(ex.answer)))


# ----------------------------------------------------------------------------------------------
# code: (function names, spec, body, reference, input kind); {a} is the argument, {t} {u} {k} {c} parameters

CODE_SPECS: list[tuple[tuple[str, ...], str, str, Callable, str]] = [
    (("count_greater", "count_above", "num_greater"), "returns how many numbers in the list {a} are greater than {t}",
     "return sum(1 for x in {a} if x > {t})", lambda xs, p: sum(1 for x in xs if x > p["t"]), "list"),
    (("count_less", "count_below", "num_less"), "returns how many numbers in the list {a} are less than {t}",
     "return sum(1 for x in {a} if x < {t})", lambda xs, p: sum(1 for x in xs if x < p["t"]), "list"),
    (("count_between", "num_between", "count_in_range"),
     "returns how many numbers in the list {a} are at least {t} and at most {u}",
     "return sum(1 for x in {a} if {t} <= x <= {u})", lambda xs, p: sum(1 for x in xs if p["t"] <= x <= p["u"]),
     "list"),
    (("sum_multiples", "sum_divisible"), "returns the sum of the numbers in the list {a} that are divisible by {k}",
     "return sum(x for x in {a} if x % {k} == 0)", lambda xs, p: sum(x for x in xs if x % p["k"] == 0), "list"),
    (("keep_greater", "filter_above", "above"), "returns a list of the numbers in {a} that are greater than {t}, in order",
     "return [x for x in {a} if x > {t}]", lambda xs, p: [x for x in xs if x > p["t"]], "list"),
    (("add_to_each", "shift", "add_all"), "returns a new list with {t} added to every number in {a}",
     "return [x + {t} for x in {a}]", lambda xs, p: [x + p["t"] for x in xs], "list"),
    (("scale", "multiply_all", "times_each"), "returns a new list with every number in {a} multiplied by {k}",
     "return [x * {k} for x in {a}]", lambda xs, p: [x * p["k"] for x in xs], "list"),
    (("scale_and_shift", "affine"), "returns a new list with every number in {a} multiplied by {k} and then increased by {t}",
     "return [x * {k} + {t} for x in {a}]", lambda xs, p: [x * p["k"] + p["t"] for x in xs], "list"),
    (("first_greater", "first_above"), "returns the first number in {a} greater than {t}, or -1 if there is none",
     "for x in {a}:\n        if x > {t}:\n            return x\n    return -1",
     lambda xs, p: next((x for x in xs if x > p["t"]), -1), "list"),
    (("count_evens", "num_even"), "returns how many even numbers the list {a} contains",
     "return sum(1 for x in {a} if x % 2 == 0)", lambda xs, p: sum(1 for x in xs if x % 2 == 0), "list"),
    (("sum_squares", "square_sum"), "returns the sum of the squares of the numbers in {a}",
     "return sum(x * x for x in {a})", lambda xs, p: sum(x * x for x in xs), "list"),
    (("spread", "value_range"), "returns the largest number in {a} minus the smallest, or 0 for an empty list",
     "return max({a}) - min({a}) if {a} else 0", lambda xs, p: max(xs) - min(xs) if xs else 0, "list"),
    (("clip_all", "cap", "limit"), "returns a new list where every number in {a} above {t} is replaced by {t}",
     "return [min(x, {t}) for x in {a}]", lambda xs, p: [min(x, p["t"]) for x in xs], "list"),
    (("count_char", "count_letter"), "returns how many times the letter '{c}' appears in the string {a}",
     "return {a}.count('{c}')", lambda s, p: s.count(p["c"]), "str"),
    (("repeat", "repeat_text"), "returns the string {a} repeated {k} times",
     "return {a} * {k}", lambda s, p: s * p["k"], "str"),
    (("reverse", "backwards"), "returns the string {a} reversed",
     "return {a}[::-1]", lambda s, p: s[::-1], "str"),
    (("remove_char", "drop_letter"), "returns the string {a} with every letter '{c}' removed",
     "return {a}.replace('{c}', '')", lambda s, p: s.replace(p["c"], ""), "str"),
    (("ends_with", "last_is"), "returns True if the string {a} ends with the letter '{c}', else False",
     "return {a}.endswith('{c}')", lambda s, p: s.endswith(p["c"]), "str"),
    (("starts_with", "first_is"), "returns True if the string {a} starts with the letter '{c}', else False",
     "return {a}.startswith('{c}')", lambda s, p: s.startswith(p["c"]), "str"),
]
ARG_NAMES = {"list": ("xs", "nums", "values"), "str": ("s", "text", "word")}


def _code_inputs(rng: random.Random, kind: str, p: dict) -> list:
    if kind == "list":
        cases = [[], [p["t"]], [rng.randint(-5, 40) for _ in range(rng.randint(3, 7))]]
        cases += [[rng.randint(0, 30) for _ in range(rng.randint(2, 6))] for _ in range(3)]
        return cases
    words = ["", p["c"], "banana", "abracadabra", "level", "cab", "moon", "data", "street", "orbit"]
    return words[:2] + rng.sample(words[2:], 4)


def make_code(rng: random.Random) -> tuple[str, str, dict]:
    names, spec, body, ref, kind = rng.choice(CODE_SPECS)
    name, arg = rng.choice(names), rng.choice(ARG_NAMES[kind])
    t = rng.randint(0, 60)
    p = {"t": t, "u": t + rng.randint(1, 20), "k": rng.randint(2, 12), "c": rng.choice("abcdeghilmnoprstu"), "a": arg}
    prompt = f"Write a Python function `{name}({arg})` that {spec.format(**p)}."
    target = f"def {name}({arg}):\n    {body.format(**p)}"
    tests = "\n".join(f"assert {name}({x!r}) == {ref(x, p)!r}" for x in _code_inputs(rng, kind, p))
    return prompt, target, {"tests": tests, "entry_point": name}


def _program(ex: Example, output: str) -> tuple[str, str]:
    return extract_code(output) + "\n", ex.answer["tests"] + "\n"


score_code, score_code_many = sandbox_scorers(_program, timeout_s=5)


# ----------------------------------------------------------------------------------------------
# choice


def make_choice(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.choice(["largest", "smallest", "sum", "order", "odd"])
    if kind in ("largest", "smallest"):
        opts = rng.sample(range(10, 100), 4)
        gold = max(opts) if kind == "largest" else min(opts)
        q, why = f"Which number is the {kind}?", f"The {kind} number is {gold}."
    elif kind == "sum":
        a, b = rng.randint(5, 60), rng.randint(5, 60)
        gold = a + b
        opts = [gold] + rng.sample([gold + d for d in (-10, -2, -1, 1, 2, 10) if gold + d > 0], 3)
        q, why = f"What is {a} + {b}?", f"{a} + {b} = {gold}."
    elif kind == "order":
        people = rng.sample(NAMES, 4)  # people[0] tallest
        facts = [f"{people[i]} is taller than {people[i + 1]}." for i in range(3)]
        rng.shuffle(facts)
        want = rng.choice(["tallest", "shortest"])
        gold = people[0] if want == "tallest" else people[3]
        opts = list(people)
        q, why = " ".join(facts) + f" Who is the {want}?", f"{gold} is the {want}."
    else:
        evens = rng.sample(range(2, 99, 2), 3)
        gold = rng.randrange(1, 99, 2)
        opts = evens + [gold]
        q, why = "Which number is odd?", f"{gold} is odd; the others are even."
    rng.shuffle(opts)
    letter = LETTERS[opts.index(gold)]
    prompt = q + "\n" + "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(opts))
    return prompt, f"{why}\nAnswer: {letter}", letter


def score_choice(ex: Example, output: str) -> Score:
    got = extract_letter(output)
    return Score(got, got == ex.answer)


# ----------------------------------------------------------------------------------------------
# table


def make_table(rng: random.Random) -> tuple[str, str, str]:
    kind = rng.choice(["times", "multiples", "people"])
    if kind == "times":
        k, a = rng.randint(2, 12), rng.randint(1, 6)
        b = a + rng.randint(5, 9)
        prompt = f"Write the multiplication table of {k} from {a} to {b}, one line per row, like `{k} x {a} = {k * a}`."
        return prompt, "\n".join(f"{k} x {i} = {k * i}" for i in range(a, b + 1)), "text"
    if kind == "multiples":
        k, a = rng.randint(3, 9), rng.randint(1, 60)
        b = a + rng.randint(25, 60)
        prompt = f"List the numbers from {a} to {b} that are divisible by {k}, as a JSON array."
        return prompt, json.dumps([i for i in range(a, b + 1) if i % k == 0]), "json"
    people = [(n, rng.randint(18, 80)) for n in rng.sample(NAMES, rng.randint(3, 6))]
    listing = ", ".join(f"{n} {a}" for n, a in people)
    prompt = f"Make a markdown table with columns name and age, sorted by age from youngest: {listing}."
    rows = sorted(people, key=lambda p: (p[1], p[0]))
    return prompt, "\n".join(["| name | age |", "|---|---|"] + [f"| {n} | {a} |" for n, a in rows]), "text"


def _norm_lines(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.strip().splitlines() if line.strip()]


def score_table(ex: Example, output: str) -> Score:
    out = output.strip()
    if ex.meta.get("format") == "json":
        try:
            return Score(out, json.loads(out) == json.loads(ex.answer))
        except json.JSONDecodeError:
            return Score(out, False)
    return Score(out, _norm_lines(out) == _norm_lines(ex.answer))


# ----------------------------------------------------------------------------------------------
# splits and the registry


def _generate(name: str, rng: random.Random) -> Example:
    if name == "arith":
        prompt, target, answer = make_arith(rng)
        return Example("", prompt, target, answer)
    if name == "code":
        prompt, target, answer = make_code(rng)
        return Example("", prompt, target, answer, {"entry_point": answer["entry_point"]})
    if name == "choice":
        prompt, target, answer = make_choice(rng)
        return Example("", prompt, target, answer)
    prompt, target, fmt = make_table(rng)
    return Example("", prompt, target, target, {"format": fmt})


# The distinct test prompts each family supplies within the loader's search (measured; code has few).
TEST_SIZES = {"arith": 100_000, "code": 600, "choice": 100_000, "table": 8000}


def load(name: str, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
    """n examples of `name` in `split` (default 500 test / 20000 train; at most TEST_SIZES test). Test prompts are distinct;
    train prompts may repeat (with different hidden tests or numbers elsewhere)."""
    return generated_split("synthetic", name, split, n, seed, TEST_SIZES[name], lambda rng: _generate(name, rng))


def _task(name: str, kind: str, score, description: str, score_many=None) -> Task:
    return Task(name, kind, ("train", "test"), lambda split, n=None, seed=0: load(name, split, n, seed), score,
                description, score_many)


TASKS: dict[str, Task] = {
    "arith": _task("arith", "math", score_arith, "multi-step arithmetic word problems, worked solution, '#### N'"),
    "code": _task("code", "code", score_code, "a Python function from a one-line spec, hidden tests",
                  score_code_many),
    "choice": _task("choice", "multiple_choice", score_choice, "four-option multiple choice, 'Answer: X'"),
    "table": _task("table", "structured", score_table, "multiplication tables, JSON lists, markdown tables"),
}


MIXTURE = ("arith", "code", "choice", "table")  # what data = "synthetic" trains on


def mixture(split: str, n: int, seed: int = 0, tasks: tuple[str, ...] = MIXTURE) -> list[dict]:
    """Training records {"query", "response", "task"}: equal shares of each task, interleaved."""
    per = -(-n // len(tasks))
    loaded = [load(t, split, per, seed) for t in tasks]
    out = [{"query": ex.prompt, "response": ex.target, "task": t}
           for group in zip(*loaded) for t, ex in zip(tasks, group)]
    return out[:n]
