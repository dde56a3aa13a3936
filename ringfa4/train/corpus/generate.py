"""Writes tiny_stories.txt, the small text corpus the default training run reads.

The corpus is made here, from a seeded grammar of short stories and arithmetic drills, so the
package ships text nobody else wrote and a byte-level model has structure to learn within a few
hundred CPU steps (spelling, recurring names, sums). Run `python -m ringfa4.train.corpus.generate`
to rebuild it; the output is byte-identical for the same seed.
"""
import random
from pathlib import Path

NAMES = ["Ada", "Bruno", "Cleo", "Dara", "Emil", "Fern", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena",
         "Milo", "Nell", "Otto", "Pia", "Quin", "Rosa", "Sami", "Tess"]
ANIMALS = ["fox", "owl", "otter", "badger", "heron", "mole", "hare", "wren", "beaver", "lynx"]
ADJECTIVES = ["quiet", "curious", "brave", "sleepy", "clever", "gentle", "restless", "patient", "cheerful"]
PLACES = ["river", "hill", "orchard", "mill", "meadow", "harbour", "forest", "bridge", "garden", "market"]
TIMES = ["morning", "evening", "spring", "winter", "Sunday", "autumn", "night"]
ACTIVITIES = [("count the boats", "counted the boats"), ("gather apples", "gathered apples"),
              ("watch the clouds", "watched the clouds"), ("mend a net", "mended a net"),
              ("read old maps", "read old maps"), ("build a small raft", "built a small raft"),
              ("listen to the rain", "listened to the rain"), ("carry bread", "carried bread")]
OBJECTS = ["a blue lantern", "a copper key", "a torn map", "a wooden flute", "a jar of honey",
           "a silver bell", "a heavy stone", "a paper boat"]
FEELINGS = ["glad", "surprised", "worried", "proud", "puzzled", "calm"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]


def story(rng):
    name, friend = rng.sample(NAMES, 2)
    animal, friend_animal = rng.sample(ANIMALS, 2)
    place, other_place = rng.sample(PLACES, 2)
    plan, done = rng.choice(ACTIVITIES)
    thing = rng.choice(OBJECTS)
    n = rng.randrange(2, len(NUMBER_WORDS))
    lines = [
        f"{name} the {rng.choice(ADJECTIVES)} {animal} lived by the {place}.",
        f"Every {rng.choice(TIMES)}, {name} went to the {other_place} to {plan}.",
        f"One day {name} found {thing} near the {other_place} and felt {rng.choice(FEELINGS)}.",
        f"{name} showed it to {friend} the {friend_animal}, who said, \"Let us take it home.\"",
        f"They walked {NUMBER_WORDS[n]} miles back to the {place}.",
        f"That {rng.choice(TIMES)}, {name} and {friend} {done} together, and {name} kept {thing}.",
    ]
    return " ".join(lines) + "\n\n"


def drill(rng):
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        return f"Question: what is {a} plus {b}? Answer: {a + b}.\n"
    hi, lo = max(a, b), min(a, b)
    return f"Question: what is {hi} minus {lo}? Answer: {hi - lo}.\n"


def generate(seed=2026, size=400_000):
    rng = random.Random(seed)
    parts, total = [], 0
    while total < size:
        part = story(rng) if rng.random() < 0.7 else "".join(drill(rng) for _ in range(4)) + "\n"
        parts.append(part)
        total += len(part)
    return "".join(parts)


if __name__ == "__main__":
    out = Path(__file__).with_name("tiny_stories.txt")
    out.write_text(generate(), encoding="ascii")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
