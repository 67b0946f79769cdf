"""Write data/train_prompts_large.jsonl: ~13,000 varied distillation prompts (issue 18).

    python data/make_distill_prompts.py [--count 13000]

Deterministic (seeded). Eight kinds, as a chat user's first turns go: writing, roleplay, reasoning,
math, coding, extraction, STEM and humanities, plus the everyday how-to questions of
`make_extra_prompts.py`; answer shapes vary (lists, paragraphs, code, worked numbers, one line).
Every prompt is built here from our own word lists and templates (none comes from the public
MT-Bench or Vicuna-Bench question sets), and any that appears in `benchmarks/prompts.jsonl` or in the
earlier training files is skipped, so the bench measures the head on prompts it never saw.
"""

import argparse
import json
import random
from pathlib import Path

from make_extra_prompts import TEMPLATES as HOWTO_TEMPLATES
from make_extra_prompts import TOPICS as HOWTO_TOPICS

NAMES = "Ava Ben Chen Dara Eli Fatima Gus Hana Ivan Jonas Kemal Lena Mateo Nia Omar Priya Quinn Rosa Sam Tomas Uma Viktor Wen Yara Zane".split()
CHARACTERS = ["a retired lighthouse keeper", "a nervous young chef", "a robot who collects stamps", "a grandmother who learns to skateboard",
              "a detective afraid of the dark", "a cat who runs a bakery", "a student on her first day at university",
              "an astronaut returning home", "a farmer who finds a strange seed", "a shy librarian", "a street musician",
              "a child who can talk to birds", "an old clockmaker", "a mountain guide", "a lost tourist", "a village doctor"]
SITUATIONS = ["discovers a hidden door", "has to give a speech", "loses something important", "meets an old friend by chance",
              "gets stuck in an elevator", "wins a contest by accident", "must cross a flooded river", "finds a letter from the past",
              "has one day to fix a mistake", "teaches someone an unexpected skill", "plans a surprise party", "moves to a tiny island"]
FORMS = ["four rhyming lines", "a haiku", "free verse", "a limerick", "two short stanzas"]
RECIPIENTS = ["my landlord", "a hiring manager", "my neighbour", "the city council", "a customer", "my team", "a teacher"]
PRODUCTS = ["a reusable water bottle", "noise-cancelling headphones", "a folding bicycle", "a smart thermostat", "a wool sweater",
            "a camping stove", "an e-reader", "a standing desk", "a houseplant kit", "a language-learning app"]
ROLES = ["travel agent", "personal trainer", "museum guide", "bank clerk", "park ranger", "nutritionist", "car mechanic",
         "librarian", "pharmacist", "gardener", "tech support agent", "history teacher", "barista", "tailor"]
ITEMS = ["notebooks", "apples", "tickets", "candles", "pens", "mugs", "plants", "books", "scarves", "batteries"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a sentence", "merges two sorted lists",
              "removes duplicates from a list while keeping order", "returns the n-th Fibonacci number", "finds the largest word in a text",
              "converts Celsius to Fahrenheit", "checks whether a word is a palindrome", "sums the digits of an integer",
              "flattens a nested list", "counts word frequencies in a text", "validates an email address with a simple rule",
              "rotates a list by k positions", "computes the average of a list, ignoring None values", "groups words by their first letter",
              "finds the second largest number in a list", "parses a date string like 2024-03-15", "transposes a matrix",
              "checks whether two words are anagrams", "returns the common elements of two lists", "formats a number with commas"]
LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "Java", "C", "Ruby", "a shell script"]
SNIPPETS = ["for i in range(3):\n    print(i * i)", "x = [n for n in range(10) if n % 2]\nprint(sum(x))",
            "def f(s):\n    return s[::-1].upper()", "d = {}\nfor w in 'a b a c'.split():\n    d[w] = d.get(w, 0) + 1",
            "total = 0\nwhile total < 20:\n    total += 7\nprint(total)", "nums = sorted([5, 2, 9])\nprint(nums[-1] - nums[0])"]
STEM = ["photosynthesis", "the greenhouse effect", "how a battery stores energy", "DNA replication", "plate tectonics",
        "why the sky is blue", "how airplanes stay in the air", "the speed of sound", "how a refrigerator works", "nuclear fusion in stars",
        "the difference between weather and climate", "how antibiotics work", "the water cycle", "how GPS finds your position",
        "how the heart pumps blood", "what an algorithm is", "how a compiler works", "why ice floats", "how vaccines train the immune system",
        "what entropy means", "how a rainbow forms", "how bridges carry weight", "what a black hole is", "how solar panels make electricity"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("speed", "velocity"), ("mass", "weight"), ("an atom", "a molecule"),
         ("RAM", "storage"), ("a comet", "an asteroid"), ("AC", "DC current"), ("a simile", "a metaphor"), ("debt", "deficit"),
         ("a republic", "a democracy"), ("an alligator", "a crocodile"), ("baking soda", "baking powder"), ("HTTP", "HTTPS")]
EVENTS = ["the fall of the Western Roman Empire", "the invention of the printing press", "the Industrial Revolution", "the Black Death",
          "the voyages of Zheng He", "the building of the pyramids of Giza", "the Meiji Restoration", "the end of the Cold War",
          "the abolition of slavery in the British Empire", "the first Olympic Games of the modern era", "the Dust Bowl",
          "the founding of the Red Cross", "the age of sail", "the rise of the Mongol Empire"]
ADJECTIVES = ["cheerful", "formal", "friendly", "brief", "detailed", "humorous", "calm", "enthusiastic"]
AUDIENCES = ["", " Keep it under 100 words.", " Explain it to a ten-year-old.", " Use an everyday analogy.",
             " Write for a high-school student.", " Answer in three bullet points.", " Give one concrete example.",
             " Then add a one-line summary.", " Mention a common misconception."]
CODE_EXTRAS = ["", " Include a short docstring.", " Add two example calls.", " Explain its time complexity.",
               " Handle empty input.", " Write it without using library helpers."]


def writing(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return "paragraphs", f"Write a short story about {rng.choice(CHARACTERS)} who {rng.choice(SITUATIONS)}."
    if kind == 1:
        return "paragraphs", f"Write a {rng.choice(ADJECTIVES)} email to {rng.choice(RECIPIENTS)} about {rng.choice(HOWTO_TOPIC_LIST)}."
    if kind == 2:
        return "paragraphs", f"Write a poem about {rng.choice(HOWTO_TOPIC_LIST)} as {rng.choice(FORMS)}."
    if kind == 3:
        return "paragraphs", f"Write a {rng.choice(ADJECTIVES)} product description for {rng.choice(PRODUCTS)}."
    return "list", f"Give me {rng.randint(3, 8)} catchy titles for a blog post about {rng.choice(HOWTO_TOPIC_LIST)}."


def roleplay(rng):
    role, topic = rng.choice(ROLES), rng.choice(HOWTO_TOPIC_LIST)
    kind = rng.randrange(3)
    if kind == 0:
        return "paragraphs", f"Pretend you are a {role}. A customer asks you for advice on {topic}. Answer in character."
    if kind == 1:
        return "paragraphs", f"You are a {rng.choice(ADJECTIVES)} {role}. Introduce yourself and explain what you do all day."
    return "list", f"As a {role}, what {rng.randint(3, 6)} questions would you ask someone who wants help with {topic}?"


def reasoning(rng):
    a, b, c = rng.sample(NAMES, 3)
    kind = rng.randrange(4)
    if kind == 0:
        return "paragraphs", f"{a} is older than {b}, and {b} is older than {c}. Who is the youngest? Explain your reasoning."
    if kind == 1:
        n = rng.randint(3, 9)
        return "paragraphs", f"{a} has {n} boxes and puts {n + rng.randint(1, 5)} marbles in them. Must one box hold two marbles? Why?"
    if kind == 2:
        d = rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"])
        return "paragraphs", f"If today is {d}, what day will it be in {rng.randint(10, 100)} days? Show how you worked it out."
    return "paragraphs", f"{a} says {b} is lying. {b} says {c} is lying. {c} says both {a} and {b} are lying. Who tells the truth?"


def math(rng):
    kind = rng.randrange(5)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == 0:
        price, n = rng.randint(2, 40), rng.randint(2, 12)
        paid = price * n + rng.randint(1, 50)
        return "math", f"{item.capitalize()} cost ${price} each. {name} buys {n} and pays with ${paid}. How much change is there?"
    if kind == 1:
        a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(-30, 30)
        return "math", f"Solve for x: {a}x + {b} = {a * x + b}. Show each step."
    if kind == 2:
        return "math", f"What is {rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {rng.randint(20, 2000)}? Explain."
    if kind == 3:
        v, t = rng.randint(20, 120), rng.randint(2, 9)
        return "math", f"A train travels at {v} km/h for {t} hours and {rng.randint(5, 55)} minutes. How far does it go?"
    w, h = rng.randint(2, 30), rng.randint(2, 30)
    return "math", f"A rectangle is {w} m wide and {h} m long. What are its area and perimeter?"


def coding(rng):
    kind = rng.randrange(3)
    if kind == 0:
        return "code", f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}.{rng.choice(CODE_EXTRAS)}"
    if kind == 1:
        return "code", f"Explain what this Python code does and what it prints:\n\n{rng.choice(SNIPPETS)}"
    if rng.random() < 0.5:
        return "paragraphs", f"How would you test a function that {rng.choice(CODE_TASKS)}?{rng.choice(AUDIENCES)}"
    return "list", f"What are {rng.randint(3, 6)} good habits for writing readable {rng.choice(LANGUAGES)} code?"


def extraction(rng):
    a, b = rng.sample(NAMES, 2)
    day, month = rng.randint(1, 28), rng.choice(["March", "June", "September", "November", "January"])
    text = (f"On {month} {day}, {a} met {b} in the library to plan a trip about {rng.choice(HOWTO_TOPIC_LIST)}; "
            f"they agreed to spend ${rng.randint(50, 900)} and leave {rng.randint(2, 9)} days later.")
    kind = rng.randrange(3)
    if kind == 0:
        return "list", f"Extract every name, date and amount of money from this text as a list:\n\n{text}"
    if kind == 1:
        return "paragraphs", f"Summarize this in one sentence:\n\n{text}"
    return "paragraphs", f"Rewrite this text in a {rng.choice(ADJECTIVES)} tone:\n\n{text}"


def stem(rng):
    kind = rng.randrange(3)
    if kind == 0:
        return "paragraphs", f"Explain {rng.choice(STEM)}.{rng.choice(AUDIENCES)}"
    if kind == 1:
        x, y = rng.choice(PAIRS)
        return "paragraphs", f"What is the difference between {x} and {y}?{rng.choice(AUDIENCES)}"
    return "list", f"List {rng.randint(3, 7)} surprising facts about {rng.choice(STEM)}."


def humanities(rng):
    event = rng.choice(EVENTS)
    kind = rng.randrange(6)
    if kind == 0:
        return "list", f"What were the main causes of {event}?{rng.choice(AUDIENCES)}"
    if kind == 1:
        return "paragraphs", f"How did {event} change everyday life?{rng.choice(AUDIENCES)}"
    if kind == 2:
        return "paragraphs", f"Who were the key people in {event}, and what did they do?{rng.choice(AUDIENCES)}"
    if kind == 3:
        return "paragraphs", f"Write a short news report as if {event} were happening today."
    if kind == 4:
        return "list", f"What can we learn today from {event}? Give {rng.randint(3, 6)} lessons."
    return "paragraphs", f"Imagine you lived through {event}. Write a short diary entry as {rng.choice(CHARACTERS)}."


def howto(rng):
    shape, template = rng.choice(HOWTO_TEMPLATES)
    return shape, template.format(t=rng.choice(HOWTO_TOPIC_LIST), n=rng.randint(3, 8))


HOWTO_TOPIC_LIST = [t.strip() for t in HOWTO_TOPICS.split(";") if t.strip()]
KINDS = {"writing": writing, "roleplay": roleplay, "reasoning": reasoning, "math": math, "coding": coding,
         "extraction": extraction, "stem": stem, "humanities": humanities, "howto": howto}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=13000)
    parser.add_argument("--out", default="data/train_prompts_large.jsonl")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    rng = random.Random(18)
    seen = {json.loads(line)["turns"][0] for line in (root / "benchmarks/prompts.jsonl").read_text().splitlines() if line}
    for name in ("train_prompts.jsonl", "train_prompts_extra.jsonl"):
        seen |= {json.loads(line)["prompt"] for line in (root / "data" / name).read_text().splitlines() if line}
    rows, names = [], list(KINDS)
    quota = {name: args.count // len(names) + (1 if i < args.count % len(names) else 0) for i, name in enumerate(names)}
    for category in names:  # each kind up to its share (a kind that runs out of new prompts stops early)
        made = misses = 0
        while made < quota[category] and misses < 2000:
            shape, prompt = KINDS[category](rng)
            if prompt in seen:
                misses += 1
                continue
            seen.add(prompt)
            made += 1
            rows.append({"id": 100000 + len(rows), "category": category, "shape": shape, "prompt": prompt})
    rng.shuffle(rows)
    with open(root / args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    counts = {c: sum(r["category"] == c for r in rows) for c in names}
    print(f"wrote {len(rows)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
