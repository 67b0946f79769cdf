"""Builds benchmarks/long_prompts.jsonl: the long-document prompt set of `mlx-specdec bench --context-length`.

    .venv/bin/python benchmarks/long_prompts.py [--output benchmarks/long_prompts.jsonl]

Documents: the licence texts Debian ships in every install (/usr/share/common-licenses, package
base-files); their own terms allow verbatim copies. Each prompt is a document, cut after a whole
paragraph (blank-line separated, so it reads naturally; a short licence is followed by a second
one), then one request. Three sizes, counted in the default model's tokens (SmolLM2-135M-Instruct)
with its chat template applied, the way the engine encodes a bench prompt (`lm.encode_prompt`):

    2k  1800-2048 tokens (each cut aims at 1950)
    4k  3600-4096 tokens (aims at 3900)
    6k  6000-7000 tokens (aims at 6500)

and three kinds per size (the record's `kind`, also its `category`, so `--categories` picks them):

    question  a question whose answer is in the document (`evidence`: the passage that answers it)
    summary   "Summarize section X ..." or "Summarize ... in 5 bullet points"
    needle    "The pass key is NNNNN. Remember it." inserted as its own paragraph at 10%, 50% and
              90% of the document (`depth`, by characters), then "What is the pass key?";
              `expected` is the key (a five-digit number found nowhere else in the prompt)

Record fields: question_id, category, turns (what `load_prompts` reads), context, kind, tokens,
source, and expected + depth (needles) or evidence (the other kinds). Deterministic: the same
texts, tokenizer and code give the same file byte for byte (the pass keys come from a fixed seed).
The builder refuses to write a record outside its range or whose evidence got cut off.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Callable, List, Optional

LICENSES = Path("/usr/share/common-licenses")
OUTPUT = Path(__file__).resolve().parent / "long_prompts.jsonl"
SIZES = {"2k": (1800, 2048, 1950), "4k": (3600, 4096, 3900), "6k": (6000, 7000, 6500)}  # low, high, aim
DEPTHS = (0.1, 0.5, 0.9)
NEEDLE = "The pass key is {key}. Remember it."
NEEDLE_QUESTION = ("A pass key is hidden in the document above. What is the pass key? "
                   "Answer with the number only.")
BULLETS = "Summarize the document above in 5 bullet points."

# (size, kind, source files in order, request, evidence: passages the cut must keep)
SPECS = [
    ("2k", "question", ["Apache-2.0"],
     "According to section 3 of the license above, what happens to the patent licenses granted to You "
     "if You institute patent litigation claiming that the Work infringes a patent?",
     ["shall terminate as of the date such litigation is filed"]),
    ("2k", "question", ["GPL-1"],
     "According to the license above, may you charge a fee for the physical act of transferring a copy "
     "of the Program?", ["You may charge a fee for the physical act of transferring a copy"]),
    ("2k", "question", ["MPL-2.0"],
     'How does the license above define a "Larger Work"?',
     ["means a work that combines Covered Software with other material"]),
    ("2k", "summary", ["Apache-2.0"], "Summarize section 4 (Redistribution) of the license above.",
     ["4. Redistribution.", "5. Submission of Contributions."]),
    ("2k", "summary", ["GPL-1"], BULLETS, []),
    ("2k", "summary", ["MPL-2.0"], "Summarize section 2 (License Grants and Conditions) of the license above.",
     ["2. License Grants and Conditions", "3. Responsibilities"]),
    ("2k", "needle", ["GPL-2"], NEEDLE_QUESTION, []),

    ("4k", "question", ["GPL-2"],
     "According to section 3 of the license above, for at least how many years must a written offer "
     "to give any third party the source code remain valid?", ["valid for at least three years"]),
    ("4k", "question", ["LGPL-2.1"],
     'According to section 5 of the license above, is a "work that uses the Library", in isolation, '
     "a derivative work of the Library?", ["in isolation, is not a derivative work of the Library"]),
    ("4k", "question", ["GFDL-1.3"],
     "According to section 3 of the license above, how many printed copies of the Document must you "
     "publish before you have to enclose them in covers that carry the Cover Texts?",
     ["numbering more than 100"]),
    ("4k", "summary", ["GFDL-1.3"], "Summarize section 4 (MODIFICATIONS) of the license above.",
     ["4. MODIFICATIONS", "5. COMBINING DOCUMENTS"]),
    ("4k", "summary", ["MPL-2.0"], BULLETS, []),
    ("4k", "summary", ["MPL-1.1"], "Summarize section 3 (Distribution Obligations) of the license above.",
     ["3. Distribution Obligations.", "4. Inability to Comply Due to Statute or Regulation."]),
    ("4k", "needle", ["LGPL-2.1"], NEEDLE_QUESTION, []),

    ("6k", "question", ["GPL-3"],
     "According to section 8 of the license above, if this is the first time a copyright holder has "
     "notified you of a violation, within how many days after receiving the notice must you cure the "
     "violation for your license to be reinstated permanently?",
     ["you cure the violation prior to 30 days after your receipt of the notice"]),
    ("6k", "question", ["LGPL-2.1", "LGPL-3"],
     "According to section 3 of the GNU Lesser General Public License version 2.1 above, once you apply "
     "the terms of the ordinary GNU GPL instead of the LGPL to a given copy of the Library, can that "
     "change be undone for that copy?", ["it is irreversible for that copy"]),
    ("6k", "question", ["MPL-1.1", "MPL-2.0"],
     "According to section 3.2 of the Mozilla Public License 1.1 above, for how long must the Source "
     "Code version of a Modification made available through an Electronic Distribution Mechanism "
     "remain available?", ["must remain available for at least twelve (12) months"]),
    ("6k", "summary", ["GPL-3"], "Summarize section 6 (Conveying Non-Source Forms) of the license above.",
     ["6. Conveying Non-Source Forms.", "7. Additional Terms."]),
    ("6k", "summary", ["MPL-1.1", "MPL-2.0"], "Summarize the two licenses above in 5 bullet points.",
     ["Mozilla Public License Version 2.0"]),
    ("6k", "summary", ["LGPL-2.1", "LGPL-3"],
     "Summarize section 6 of the GNU Lesser General Public License version 2.1 above.",
     ["6. As an exception to the Sections above", "7. You may place library facilities"]),
    ("6k", "needle", ["GPL-3"], NEEDLE_QUESTION, []),
]


def paragraphs(names: List[str]) -> List[str]:
    """The source files' paragraphs in order: blank-line separated, trailing spaces and form feeds
    (page breaks) dropped, line breaks inside a paragraph kept."""
    out = []
    for name in names:
        path = LICENSES / name
        if not path.is_file():
            sys.exit(f"error: {path} is missing (Debian's base-files package ships it)")
        text = path.read_text(encoding="utf-8").replace("\f", "")
        lines = "\n".join(line.rstrip() for line in text.splitlines())
        out += [p for p in re.split(r"\n\s*\n", lines) if p.strip()]
    return out


def normalized(text: str) -> str:
    return " ".join(text.split())


def with_needle(paras: List[str], needle: str, depth: float) -> List[str]:
    """The needle as a paragraph of its own at the boundary nearest `depth` of the text's characters."""
    total = sum(len(p) + 2 for p in paras)
    starts = [0]
    for p in paras:
        starts.append(starts[-1] + len(p) + 2)
    at = min(range(1, len(paras)), key=lambda i: abs(starts[i] / total - depth))
    return paras[:at] + [needle] + paras[at:]


def fit(paras: List[str], make: Callable[[List[str]], str], count: Callable[[str], int], aim: int):
    """The longest paragraph prefix whose prompt has at most `aim` tokens (binary search: tokens
    grow with paragraphs). Returns (prompt text, tokens, paragraphs used)."""
    lo, hi = 1, len(paras)
    if count(make(paras)) <= aim:
        lo = hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(make(paras[:mid])) <= aim:
            lo = mid
        else:
            hi = mid - 1
    text = make(paras[:lo])
    return text, count(text), lo


def build(count: Callable[[str], int]) -> List[dict]:
    rng = random.Random(20240611)
    records = []
    numbers = {size: {} for size in SIZES}
    for size, kind, names, request, evidence in SPECS:
        low, high, aim = SIZES[size]
        paras = paragraphs(names)
        variants: List[Optional[float]] = list(DEPTHS) if kind == "needle" else [None]
        for depth in variants:
            if kind == "needle":
                name = f"{size}-needle-{round(depth * 100)}"
            else:
                numbers[size][kind] = numbers[size].get(kind, 0) + 1
                name = f"{size}-{kind}-{numbers[size][kind]}"
            record = {"question_id": name, "category": kind}
            if kind == "needle":
                key = str(rng.randint(10000, 99999))
                while key in "\n".join(paras):
                    key = str(rng.randint(10000, 99999))
                needle = NEEDLE.format(key=key)
                make = lambda ps, n=needle, d=depth: "\n\n".join(with_needle(ps, n, d) + [request])
            else:
                make = lambda ps: "\n\n".join(ps + [request])
            text, tokens, used = fit(paras, make, count, aim)
            source = " + ".join(names)
            if used < len(paras):
                source += f" (first {used} of {len(paras)} paragraphs)"
            if not low <= tokens <= high:
                sys.exit(f"error: {record['question_id']} has {tokens} tokens, outside {low}-{high}")
            for passage in evidence:
                if normalized(passage) not in normalized(text):
                    sys.exit(f"error: {record['question_id']}: the cut drops {passage!r}")
            record.update(turns=[text], context=size, kind=kind, tokens=tokens, source=source)
            if kind == "needle":
                record.update(expected=key, depth=depth)
            else:
                record["evidence"] = evidence
            records.append(record)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mlx_specdec  # noqa: F401  (preloads OpenBLAS before mlx)
    from mlx_specdec.engine import Engine

    lm = Engine.load("default").lm
    records = build(lambda text: len(lm.encode_prompt(text, chat=True)))
    args.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    for r in records:
        print(f"{r['question_id']:<16} {r['tokens']:>5} tokens  {r['source']}")
    print(f"wrote {len(records)} prompts ({args.output.stat().st_size // 1024} KiB) to {args.output}")


if __name__ == "__main__":
    main()
