"""Deterministic text to train the test models' tokenizers on: sentences drawn from a small seeded
grammar of chat-like English (greetings, questions and answers, requests, instructions, lists),
with numbers, JSON and Python snippets, so that the prompts tests send tokenize into whole words
as they would with a real model's tokenizer.

Nothing here depends on the machine: the words are in this file and the draws come from
:class:`random.Random` with a fixed seed (its algorithm is stable across Python versions), so
the same recipe gives the same text, and so the same tokenizer, everywhere. Made-up place and
person names drawn from syllables give the larger tokenizers (16 k) enough distinct words.
"""

from __future__ import annotations

import random

GREETINGS = ["Hello", "Hi", "Hey", "Good morning", "Good evening", "Welcome", "Thanks", "Sure"]
PEOPLE = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
COUNTRIES = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Norway": "Oslo",
    "Poland": "Warsaw",
    "India": "Delhi",
}
# fmt: off
TOPICS = [
    "the sea", "the moon", "a cat", "the weather", "music", "history", "the river", "a garden",
    "the city", "mountains", "friendship", "the stars", "a robot", "the forest", "coffee",
    "winter", "summer", "a train", "the ocean", "science", "mathematics", "a story", "the sun",
]
ADJECTIVES = [
    "short", "long", "simple", "happy", "quiet", "bright", "small", "large", "new", "old",
    "quick", "slow", "warm", "cold", "clear", "strange", "beautiful", "useful", "careful",
    "kind",
]
NOUNS = [
    "poem", "story", "list", "summary", "answer", "question", "function", "program", "letter",
    "email", "recipe", "plan", "table", "note", "joke", "song", "report", "message", "example",
]
VERBS = [
    "write", "explain", "describe", "summarize", "translate", "list", "compare", "count",
    "find", "show", "tell", "give", "make", "check", "read", "sort", "build", "fix",
]
OBJECTS = [
    "apples", "books", "birds", "cars", "chairs", "cups", "dogs", "files", "houses", "lamps",
    "numbers", "pages", "stones", "trees", "words", "boxes", "coins", "tickets", "windows",
]
ANSWERS = [
    "I think so.", "That is a good question.", "Of course.", "I am not sure.", "Yes.", "No.",
    "Here is what I found.", "Let me think about it.", "I can help with that.",
    "Thank you for asking.", "I hope this helps.", "Sorry, I do not know.",
]
SYLLABLES = [
    "ka", "lo", "mi", "ra", "to", "ne", "su", "vi", "da", "pe", "zu", "ba", "qui", "stra",
    "bel", "dor", "fen", "gar", "hal", "ion", "jor", "kel", "lum", "mar", "nor", "oth", "pri",
    "rin", "sol", "tha", "ur", "vel", "wen", "xan", "yor", "zel", "ar", "en", "is", "ol",
]
# fmt: on
CODE = [
    "def add(a, b):\n    return a + b",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "for i in range(10):\n    print(i)",
    "import json\ndata = json.loads(text)",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y",
    "with open(path) as f:\n    lines = f.readlines()",
    "if value is None:\n    raise ValueError('value is required')",
    "result = [x * x for x in numbers if x % 2 == 0]",
]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def _sentence(rng: random.Random) -> str:
    pick = rng.choice
    kind = rng.randrange(16)
    country = pick(sorted(COUNTRIES))
    if kind == 0:
        return f"{pick(GREETINGS)}, {pick(PEOPLE)}! How are you today?"
    if kind == 1:
        capital = COUNTRIES[country]
        return f"What is the capital of {country}? The capital of {country} is {capital}."
    if kind == 2:
        return f"Please {pick(VERBS)} a {pick(ADJECTIVES)} {pick(NOUNS)} about {pick(TOPICS)}."
    if kind == 3:
        return f"Can you {pick(VERBS)} the {pick(NOUNS)} for me? {pick(ANSWERS)}"
    if kind == 4:
        n = rng.randint(0, 999)
        place = pick(["box", "room", "list"])
        return f"There are {n} {pick(OBJECTS)} in the {pick(ADJECTIVES)} {place}."
    if kind == 5:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} plus {b}? {a} + {b} = {a + b}."
    if kind == 6:
        return f"My name is {pick(PEOPLE)} and I live in {_name(rng)}, a {pick(ADJECTIVES)} town."
    if kind == 7:
        return f'{{"name": "{pick(PEOPLE)}", "age": {rng.randint(1, 99)}, "city": "{_name(rng)}"}}'
    if kind == 8:
        return pick(CODE)
    if kind == 9:
        return f"Once upon a time, {pick(TOPICS)} and {pick(TOPICS)} met in {_name(rng)}."
    if kind == 10:
        items = ", ".join(pick(OBJECTS) for _ in range(rng.randint(2, 5)))
        return f"Here is a list: {items}. {pick(ANSWERS)}"
    if kind == 11:
        role = pick(["system", "user", "assistant"])
        return f"The {role} said: {pick(ANSWERS)} You are a helpful assistant."
    if kind == 12:
        return f"{pick(ANSWERS)} The {pick(ADJECTIVES)} {pick(NOUNS)} is about {pick(TOPICS)}."
    if kind == 13:
        return f"{_name(rng)} {_name(rng)} wrote a {pick(NOUNS)} in {rng.randint(1800, 2030)}."
    if kind == 14:  # a chat turn as templates lay them out: the role alone at a line's start
        role = pick(["system", "user", "assistant"])
        return f"{role}\n\n{pick(GREETINGS)}! {pick(ANSWERS)}"
    return f"{pick(['user', 'assistant'])}\n{pick(ANSWERS)} {pick(GREETINGS)}, {pick(PEOPLE)}."


def corpus(lines: int, seed: int = 0) -> list[str]:
    """``lines`` paragraphs of one to four sentences each (about 100 bytes a line)."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(lines)]
