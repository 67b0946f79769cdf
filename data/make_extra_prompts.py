"""Write data/train_prompts_extra.jsonl: more distillation prompts, topic x question-shape.

    python data/make_extra_prompts.py

Deterministic (seeded). Distinct from benchmarks/prompts.jsonl: any prompt that appears there
verbatim is skipped. Used to enlarge the ReDrafter distillation set (the LLM's own greedy answers).
"""

import json
import random
from pathlib import Path

TOPICS = """budgeting for a family; learning a new language; running a first marathon; keeping houseplants alive;
starting a podcast; composting at home; reducing screen time; training a puppy; writing a resume;
preparing for a job interview; organizing a closet; planning a road trip; brewing coffee at home;
learning to swim as an adult; saving energy in winter; hosting a dinner party; studying for exams;
improving handwriting; caring for a cat; baking bread; planting a herb garden; moving to a new city;
learning the guitar; cycling to work; camping in the rain; keeping a journal; making friends as an adult;
teaching kids to read; choosing a laptop; protecting personal data online; recycling electronics;
cooking with lentils; fixing a leaking tap; painting a room; decluttering a garage; meditating daily;
staying focused while working from home; writing a short story; public speaking; negotiating a salary;
learning to draw; caring for elderly parents; saving for retirement; buying a used car; home first aid;
birdwatching; visiting a museum with children; volunteering; reducing food waste; planning a wedding;
learning chess; improving posture; drinking more water; growing tomatoes; taking better photos with a phone;
backing up files; learning to code; staying safe while hiking; making a budget spreadsheet; knitting;
running a book club; starting a small online shop; brewing tea; preparing for a hurricane; insulating a house;
teaching a teenager to drive; choosing running shoes; learning to cook rice; writing a thank-you letter;
keeping bees; visiting Japan; learning about the solar system; understanding volcanoes; the water cycle;
how vaccines work; the history of the printing press; the Roman Empire; the French Revolution; photosynthesis;
climate change; the human heart; earthquakes; electric cars; solar panels; wind turbines; the internet;
black holes; the moon landing; ancient Egypt; the Silk Road; coral reefs; rainforests; honeybees; recycling plastic;
the stock market; inflation; credit scores; renting versus buying a home; the immune system; sleep cycles;
dinosaurs; the Olympic Games; jazz music; the Renaissance; the industrial revolution; glaciers; deserts;
migrating birds; the ocean tides; rainbows; thunderstorms; the seasons; the periodic table; magnets;
gravity; electricity at home; 3D printing; artificial intelligence; robots in factories; smartphones;
social media habits; online learning; team sports; yoga; strength training; healthy breakfasts; vegetarian cooking""".replace("\n", " ")

TEMPLATES = [
    ("list", "Give me {n} practical tips for {t}."),
    ("list", "What are the main steps involved in {t}? List them."),
    ("list", "List {n} common mistakes people make with {t}, and how to avoid them."),
    ("list", "What are the pros and cons of {t}?"),
    ("list", "Write a checklist for {t}."),
    ("paragraphs", "Explain {t} to a ten-year-old in a few short paragraphs."),
    ("paragraphs", "Write a short blog post about {t}."),
    ("paragraphs", "Why do people care about {t}? Answer in two or three paragraphs."),
    ("paragraphs", "Describe a typical day of someone who is passionate about {t}."),
    ("list", "What should a beginner know about {t}? Give the key points."),
]


def main():
    rng = random.Random(0)
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    bench = {json.loads(l)["turns"][0] for l in Path("benchmarks/prompts.jsonl").read_text().splitlines() if l}
    existing = {json.loads(l)["prompt"] for l in Path("data/train_prompts.jsonl").read_text().splitlines() if l}
    rows = []
    for topic in topics:
        for shape, template in rng.sample(TEMPLATES, 6):
            prompt = template.format(t=topic, n=rng.choice([3, 4, 5, 6, 7]))
            if prompt in bench or prompt in existing:
                continue
            rows.append({"id": 10000 + len(rows), "category": "generic", "shape": shape, "prompt": prompt})
    with open("data/train_prompts_extra.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} prompts")


if __name__ == "__main__":
    main()
