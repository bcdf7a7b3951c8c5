"""Templated conversations for the tiny default target.

Every reply follows a fixed, learnable structure (counting, written-out arithmetic, list reversal and
sorting, spelling, times tables, repeated patterns, facts about a small invented world), so that a
~1.5 M-parameter model trained for a couple of minutes produces structured answers whose blocks of
8 tokens are predictable. Everything is drawn from one seeded `random.Random`, so the corpus is
deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Conversation = list[dict[str, str]]

WORDS = [
    "apple", "river", "garden", "window", "yellow", "pencil", "silver", "rabbit", "forest", "bottle",
    "castle", "dragon", "orange", "planet", "rocket", "summer", "winter", "basket", "candle", "mirror",
    "button", "jacket", "island", "ladder", "monkey", "pepper", "tomato", "violin", "wallet", "zebra",
    "cloud", "stone", "table", "chair", "light", "music", "paper", "sugar", "tiger", "water",
]  # fmt: skip
NAMES = [
    "Ada",
    "Bruno",
    "Clara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
]
CITIES = ["Velport", "Ashford", "Brindle", "Corvale", "Dunmere", "Eastwick"]
JOBS = ["baker", "pilot", "teacher", "painter", "doctor", "farmer"]
FOODS = ["soup", "bread", "rice", "cheese", "apples", "noodles"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a careful tutor. Answer step by step."]


def _facts(rng: random.Random) -> dict[str, dict[str, str]]:
    """A fixed invented world: each name gets a city, job, food and colour."""
    return {
        name: {
            "city": rng.choice(CITIES),
            "job": rng.choice(JOBS),
            "food": rng.choice(FOODS),
            "color": rng.choice(COLORS),
        }
        for name in NAMES
    }


def _count(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(1, 60)
    stop = start + rng.randint(4, 11)
    numbers = ", ".join(str(n) for n in range(start, stop + 1))
    user = rng.choice([f"Count from {start} to {stop}.", f"Please count from {start} up to {stop}."])
    return user, f"Counting from {start} to {stop}: {numbers}. That makes {stop - start + 1} numbers."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    user = rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}."])
    ones = a % 10 + b % 10
    tens = a // 10 + b // 10 + ones // 10
    reply = (
        f"We add {a} and {b}. The ones give {a % 10} + {b % 10} = {ones}. "
        f"The tens give {a // 10} + {b // 10} + {ones // 10} = {tens}. So {a} + {b} = {a + b}."
    )
    return user, reply


def _reverse(rng: random.Random) -> tuple[str, str]:
    items = rng.sample(WORDS, rng.randint(3, 6))
    user = f"Reverse this list: {', '.join(items)}."
    reply = (
        f"Here is the list in reverse order: {', '.join(reversed(items))}. "
        f"The first item is now {items[-1]} and the last item is {items[0]}."
    )
    return user, reply


def _sort(rng: random.Random) -> tuple[str, str]:
    numbers = rng.sample(range(1, 100), rng.randint(4, 7))
    ordered = sorted(numbers)
    user = f"Sort these numbers from smallest to largest: {' '.join(map(str, numbers))}."
    reply = (
        f"Sorted from smallest to largest: {', '.join(map(str, ordered))}. "
        f"The smallest is {ordered[0]} and the largest is {ordered[-1]}."
    )
    return user, reply


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    user = rng.choice([f"How do you spell {word}?", f"Spell the word {word}."])
    reply = f"The word {word} is spelled {' - '.join(word)}. It has {len(word)} letters."
    return user, reply


def _times_table(rng: random.Random) -> tuple[str, str]:
    base, upto = rng.randint(2, 9), rng.randint(4, 7)
    rows = ", ".join(f"{base} x {i} = {base * i}" for i in range(1, upto + 1))
    return f"Write the times table of {base} up to {upto}.", f"The times table of {base}: {rows}. Done."


def _pattern(rng: random.Random) -> tuple[str, str]:
    unit = " ".join(rng.sample(["ab", "cd", "xy", "la", "mo", "ti", "ku", "ze"], rng.randint(1, 3)))
    times = rng.randint(4, 7)
    repeated = " | ".join([unit] * times)
    return (
        f"Repeat '{unit}' {times} times.",
        f"Here it is: {repeated}. That is '{unit}' repeated {times} times.",
    )


def _fact_task(world: dict[str, dict[str, str]]) -> Callable[[random.Random], tuple[str, str]]:
    def task(rng: random.Random) -> tuple[str, str]:
        name = rng.choice(NAMES)
        f = world[name]
        user = rng.choice([f"Tell me about {name}.", f"Who is {name}?", f"What do you know about {name}?"])
        reply = (
            f"{name} lives in {f['city']} and works as a {f['job']}. "
            f"{name} likes {f['food']}, and the favourite color of {name} is {f['color']}."
        )
        return user, reply

    return task


def make_conversations(num: int, seed: int, exclude_prompts: set[str] | None = None) -> list[Conversation]:
    """`num` conversations with distinct first user prompts, none of which is in `exclude_prompts`.

    About a third start with a system prompt and a quarter have a second user/assistant exchange.
    """
    rng = random.Random(seed)
    tasks = [
        _count,
        _add,
        _reverse,
        _sort,
        _spell,
        _times_table,
        _pattern,
        _fact_task(_facts(random.Random(0))),
    ]
    seen = set(exclude_prompts or ())
    conversations: list[Conversation] = []
    while len(conversations) < num:
        user, reply = rng.choice(tasks)(rng)
        if user in seen:
            continue
        seen.add(user)
        turns: Conversation = []
        if rng.random() < 0.3:
            turns.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.25:
            user2, reply2 = rng.choice(tasks)(rng)
            turns += [{"role": "user", "content": user2}, {"role": "assistant", "content": reply2}]
        conversations.append(turns)
    return conversations
