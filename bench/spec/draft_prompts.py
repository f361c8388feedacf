"""Writes bench/data/draft_prompts.jsonl: the prompt set the shipped eagle head was distilled on
(`pdserve draft train --prompts bench/data/draft_prompts.jsonl`, issue 18).

    python -m bench.spec.draft_prompts [--out bench/data/draft_prompts.jsonl]

The 48 bench prompts (pdserve/tools/bench/data/prompts.jsonl) gave a head that agrees with the
target on 0.38 of held-out rows of the same prompts but on ~0.13 of the spec-decode bench's
texts (bench/results/spec/eagle_handoff.md): too few, too alike. This set is wider, and made only from
what a fresh machine has, so it is the same on every machine with this Python:
- the bench prompts themselves;
- the opening paragraph of the docstring of every pure-Python standard-library module that
  imports cleanly (technical prose);
- the first lines of the source of one public function of each such module (code to continue);
- instructions: every task template below over a rotating subset of the topics (chat-style);
- story and essay openings of many kinds (prose to continue).
The spec-decode bench's own prompts (bench.spec.decode workloads) are not in it: its results
measure the head on text it never saw.

Deterministic: sorted module names, fixed templates, no randomness. Nothing here waits.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pathlib
import sys
import warnings

import pdserve.tools.bench as serving_bench
from bench.common.results import BENCH_DIR

BENCH_PROMPTS = pathlib.Path(serving_bench.__file__).resolve().parent / "data" / "prompts.jsonl"
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3",
                "ensurepip", "venv", "test", "xxlimited", "xxlimited_35", "xxsubtype", "_pydecimal"}

TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the immune system",
    "plate tectonics", "the printing press", "neural networks", "climate change", "the Roman Empire",
    "vaccines", "supply and demand", "the water cycle", "quantum computing", "the Silk Road",
    "recycling plastics", "jazz music", "the human heart", "volcanoes", "public key cryptography",
    "the Renaissance", "electric cars", "bees and pollination", "inflation", "the Moon landing",
    "sleep", "coral reefs", "the stock market", "DNA replication", "medieval castles",
    "solar panels", "the Olympic Games", "antibiotics", "glaciers", "the internet",
    "chess openings", "coffee", "earthquakes", "the Industrial Revolution", "rainforests",
    "version control with git", "unit testing", "database indexes", "TCP handshakes", "garbage collection",
    "recursion", "sorting algorithms", "HTTP caching", "containers and virtual machines", "regular expressions",
    "the metric system", "bicycles", "origami", "tea ceremonies", "mountain climbing",
    "the Great Wall of China", "penguins", "rainbows", "desert survival", "the history of writing",
]

TASKS = [
    "Explain {t} to a high-school student in one paragraph.",
    "Write a short blog post introduction about {t}.",
    "List the key facts about {t} as bullet points.",
    "What are three common misconceptions about {t}?",
    "Write a short story in which {t} plays an important role.",
    "Compare {t} with something from everyday life, and explain the analogy.",
    "Give a brief history of {t}.",
    "Write a quiz of four questions, with answers, about {t}.",
    "Summarise the pros and cons of {t} in a short essay.",
    "Write a poem of eight lines about {t}.",
]

OPENINGS = [
    "The storm had been building over the harbour all afternoon, and by the time the last ferry",
    "When Maria opened the letter, she knew at once that it had been written by her grandfather,",
    "In the year 2143, the colony ship Meridian had been travelling for almost two centuries when",
    "The detective looked at the muddy footprints on the kitchen floor and frowned. Whoever had",
    "It was the kind of summer when the river ran low and the whole town seemed to slow down.",
    "Nobody in the office had ever seen the new manager smile, until the morning the printer",
    "The old map showed a road that no longer existed, winding north through the forest towards",
    "Dear diary, today was the strangest day of my life. It started when the cat",
    "The dragon had not left its cave for three hundred years, but the smell of fresh bread",
    "As the train pulled out of the station, Tom realised he had left his suitcase on the platform.",
    "The experiment was supposed to take a week. Instead, on the second night, the instruments",
    "Every village has a story about the lake, and ours is no different. They say that",
    "The robot had been built to sweep floors, but it had always dreamed of",
    "She was the youngest captain the fleet had ever known, and on her first voyage",
    "The market opened at dawn, and by seven o'clock the square was full of",
    "My first job was washing dishes in a small restaurant by the sea. The owner,",
    "The scientists gathered around the screen as the first images from the probe arrived.",
    "There are two kinds of people in the world: those who read the instructions, and",
    "The history of the city begins with a bridge, built by Roman engineers across",
    "Learning a new language as an adult is hard, but it is not impossible. The first thing",
    "The most important lesson I learned from my grandmother was",
    "On the first day of school, the new teacher wrote a single word on the blackboard:",
    "In many ways, the invention of the clock changed how people thought about work.",
    "The village baker woke up at three every morning, long before the sun, to",
    "Far beneath the ice of Antarctica, a team of researchers discovered",
    "The argument started over something small: who had forgotten to buy milk. But soon",
    "Most people think of deserts as empty places, but in fact they are full of life.",
    "The spaceship's computer announced, in its calm voice, that oxygen levels were",
    "When the power went out across the whole city, the neighbours came out into the street and",
    "The painting had hung in the museum for a hundred years before anyone noticed that",
    "A good cup of tea requires three things: fresh water, the right temperature, and",
    "He had never been good at keeping secrets, so when his sister told him about",
    "The football match was tied with two minutes left when the referee",
    "Our journey through the mountains began on a cold morning in October.",
    "The letter arrived on a Tuesday, addressed to someone who had died forty years earlier.",
    "Software engineering is often described as a craft rather than a science, because",
    "The fox watched the farmhouse from the edge of the field, waiting for the lights",
    "The first rule of the island was simple: never go into the forest after dark.",
    "When I was seven, my father taught me how to ride a bicycle in the park behind our house.",
    "The city council met on Monday evening to discuss the new proposal for",
]


def _bench_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in BENCH_PROMPTS.read_text().splitlines() if line.strip()]


def _first_paragraph(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(para.split())


def _stdlib() -> tuple[list[str], list[str]]:
    """(docstring openings, function source openings) of pure-Python stdlib modules."""
    docs, code = [], []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError):   # one this platform lacks (winreg, msvcrt): skipped
            continue
        if not getattr(mod, "__file__", None) or not str(mod.__file__).endswith(".py"):
            continue
        if mod.__doc__:
            para = _first_paragraph(mod.__doc__)
            if 60 <= len(para) <= 600:
                docs.append(para)
        for attr in sorted(vars(mod)):
            fn = getattr(mod, attr)
            if attr.startswith("_") or not inspect.isfunction(fn) or getattr(fn, "__module__", None) != name:
                continue
            try:
                lines = inspect.getsource(fn).splitlines()
            except (OSError, TypeError):
                continue
            if len(lines) >= 8:
                code.append("\n".join(lines[:8]) + "\n")
                break
    return docs, code


def prompts() -> list[str]:
    docs, code = _stdlib()
    instr = [task.format(t=TOPICS[(i * 7 + j) % len(TOPICS)]) for j, task in enumerate(TASKS) for i in range(15)]
    out: list[str] = []
    for p in [*_bench_prompts(), *docs, *code, *instr, *OPENINGS]:
        if p not in out:
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(BENCH_DIR / "data" / "draft_prompts.jsonl"))
    args = ap.parse_args()
    ps = prompts()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ps))
    print(f"{len(ps)} prompts -> {out}")


if __name__ == "__main__":
    main()
