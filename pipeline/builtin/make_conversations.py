"""Write the bundled conversation dataset (conversations.jsonl).

Deterministic: `python -m pipeline.builtin.make_conversations` rewrites the
same file. The conversations are written for this project from templates
whose answers are computed (arithmetic, conversions, sorting, counting), so
the text is consistent; a handful of broken lines for the bad-input tests
go to a separate file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

SYSTEMS = [
    "You are a concise assistant. Answer in one or two sentences.",
    "You are a patient tutor who explains each step.",
    "You are a helpful assistant for engineers running training jobs on GPU servers.",
    "Answer plainly and check your arithmetic.",
]

CITIES = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Canada": "Ottawa",
    "Brazil": "Brasilia", "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago",
    "India": "New Delhi", "Spain": "Madrid", "Peru": "Lima", "Vietnam": "Hanoi",
}
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000),
         ("gigabytes", "megabytes", 1024), ("minutes", "seconds", 60), ("days", "hours", 24)]
WORDS = ["apple", "river", "stone", "garden", "window", "cloud", "ladder", "pencil", "orbit",
         "violet", "harbor", "candle", "meadow", "copper", "falcon", "silver", "thunder"]
TOPICS = {
    "speculative decoding": "a small draft model proposes several tokens and the large target "
                            "model checks them in one forward pass, keeping the ones it agrees with",
    "a KV cache": "the stored keys and values of earlier tokens, so attention does not recompute "
                  "them at every step",
    "tensor parallelism": "splitting each weight matrix across GPUs so that one layer runs on "
                          "several devices at once",
    "a learning rate warmup": "raising the learning rate slowly over the first steps so that early "
                              "updates do not destabilise training",
    "gradient clipping": "scaling gradients down when their norm is too large, which keeps one bad "
                         "batch from wrecking the weights",
    "mixed precision": "computing in bfloat16 or float16 while keeping sensitive values in float32 "
                       "to save memory and time",
    "a checkpoint": "a saved copy of the weights and optimizer state, so that training can resume "
                    "after a crash",
    "an embedding": "a learned vector for each token that the model reads instead of the raw id",
}


def arithmetic(rng: random.Random):
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["plus", "times", "minus"])
    val = {"plus": a + b, "times": a * b, "minus": a - b}[op]
    q = rng.choice([f"What is {a} {op} {b}?", f"Can you compute {a} {op} {b} for me?",
                    f"Quick one: {a} {op} {b}?"])
    steps = {"plus": f"Adding {a} and {b} gives {val}.",
             "times": f"Multiplying {a} by {b} gives {val}.",
             "minus": f"Subtracting {b} from {a} gives {val}."}[op]
    return q, f"{steps} So the answer is {val}."


def conversion(rng: random.Random):
    big, small, factor = rng.choice(UNITS)
    n = rng.randint(2, 40)
    return (f"How many {small} are in {n} {big}?",
            f"There are {factor} {small} in one of the {big}, so {n} {big} is "
            f"{n} x {factor} = {n * factor} {small}.")


def capital(rng: random.Random):
    country = rng.choice(sorted(CITIES))
    return (f"What is the capital of {country}?",
            f"The capital of {country} is {CITIES[country]}.")


def sorting(rng: random.Random):
    words = rng.sample(WORDS, rng.randint(3, 7))
    return (f"Please sort these words alphabetically: {', '.join(words)}.",
            f"Sorted alphabetically: {', '.join(sorted(words))}.")


def counting(rng: random.Random):
    words = rng.sample(WORDS, rng.randint(2, 5))
    sentence = " ".join(words)
    letters = sum(len(w) for w in words)
    return (f"How many letters are in the phrase \"{sentence}\", not counting spaces?",
            f"The words have {' + '.join(str(len(w)) for w in words)} letters, which adds up "
            f"to {letters}.")


def explain(rng: random.Random):
    topic = rng.choice(sorted(TOPICS))
    q = rng.choice([f"Can you explain {topic}?", f"What is {topic}?",
                    f"I keep hearing about {topic}. What does it mean?"])
    return q, f"In short, {topic} is {TOPICS[topic]}."


def sequence(rng: random.Random):
    start, step, n = rng.randint(1, 20), rng.randint(2, 9), rng.randint(4, 8)
    seq = [start + step * i for i in range(n)]
    return (f"Continue the sequence {', '.join(map(str, seq[:-1]))}, ...",
            f"Each number grows by {step}, so the next one is {seq[-1]}.")


MAKERS = [arithmetic, conversion, capital, sorting, counting, explain, sequence]
FOLLOW_UPS = ["Thanks! And another one:", "Great. Next:", "One more, please.", "Now this:"]


def conversation(rng: random.Random) -> dict:
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    turns = rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]
    for t in range(turns):
        q, a = rng.choice(MAKERS)(rng)
        if t:
            q = f"{rng.choice(FOLLOW_UPS)} {q}"
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


BROKEN = [
    '{"messages": [{"role": "user", "content": "unterminated"}',       # bad JSON
    '{"messages": [{"role": "user", "content": "no answer"}]}',        # no assistant turn
    '{"messages": [{"content": "who said this?"}]}',                   # missing role
    '{"messages": []}',                                                # empty
    '',                                                                # blank line
    '{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
    '{"text": "neither messages nor conversations"}',
]


def main() -> None:
    rng = random.Random(1234)
    rows = [conversation(rng) for _ in range(400)]
    with open(HERE / "conversations.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    # A ShareGPT-style copy of a few rows plus the broken lines (and one line
    # of invalid UTF-8) for the bad-input tests.
    with open(HERE / "conversations_broken.jsonl", "wb") as f:
        for i, row in enumerate(rows[:20]):
            if i % 2:
                conv = [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                         "value": m["content"]} for m in row["messages"]]
                f.write(json.dumps({"conversations": conv}).encode() + b"\n")
            else:
                f.write(json.dumps(row).encode() + b"\n")
            if i < len(BROKEN):
                f.write(BROKEN[i].encode() + b"\n")
        f.write(b'{"messages": [{"role": "user", "content": "bad \xff\xfe bytes"}]}\n')


if __name__ == "__main__":
    main()
