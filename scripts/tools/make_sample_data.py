"""Writes the sample corpora shipped in titan_kimi/assets/data/ (our own text): python scripts/tools/make_sample_data.py [--out-dir DIR]

    python scripts/tools/make_sample_data.py [--out-dir titan_kimi/assets/data]

Outputs (deterministic: the same bytes on every run):
- ``sample_text.jsonl``: short English documents, one ``{"text": ...}`` per line, for packed
  pre-training runs and the tokenizer trainer.
- ``sample_hellaswag.jsonl``: made-up multiple-choice items in the public HellaSwag schema
  (``ind, activity_label, ctx_a, ctx_b, ctx, endings, source_id, split, split_type, label``; the label
  is a string, as in the Hugging Face copy of the data set).
- ``sample_text_validation.jsonl``, ``sample_hellaswag_validation.jsonl``: the validation splits of both
  (``data.validation_path = ""``), drawn from their own seeds so the training files stay as they were.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "titan_kimi" / "assets" / "data"
SEED = 20260101
NUM_TEXT_DOCS = 700
NUM_HELLASWAG_ITEMS = 200
NUM_TEXT_VALIDATION_DOCS = 70
NUM_HELLASWAG_VALIDATION_ITEMS = 40

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko",
         "Liam", "Maya", "Noor", "Oscar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera",
         "Wen", "Ximena", "Yusuf", "Zoe"]
PLACES = ["a small harbour town", "a village at the edge of the forest", "a busy city flat",
          "a farmhouse on the hill", "a narrow street near the river", "a village on an island with one ferry a day",
          "a mountain town", "a quiet suburb"]
SHOPS = ["bakery", "market", "library", "hardware store", "bookshop", "post office", "pharmacy", "café"]
ITEMS = ["bread", "apples", "a newspaper", "nails", "a map", "stamps", "tea", "candles", "honey", "rice"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FEELINGS = ["happy", "tired", "curious", "calm", "surprised", "proud", "nervous", "cheerful"]
ANIMALS = ["cat", "dog", "goat", "parrot", "rabbit", "tortoise", "hen", "horse"]
COLOURS = ["red", "blue", "green", "yellow", "grey", "white", "orange", "purple"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Tunis", "Quebec", "Perth", "Porto", "Riga"]
SKIES = ["clear", "cloudy", "grey and low", "bright blue", "hazy", "stormy", "full of small clouds"]
DISHES = {
    "pancakes": ["flour", "milk", "two eggs", "a pinch of salt", "butter"],
    "vegetable soup": ["carrots", "an onion", "potatoes", "water", "salt", "pepper"],
    "fried rice": ["cooked rice", "an egg", "peas", "soy sauce", "a spring onion"],
    "lemon tea": ["black tea", "hot water", "a slice of lemon", "honey"],
    "tomato salad": ["tomatoes", "olive oil", "basil", "salt"],
    "flatbread": ["flour", "water", "salt", "a spoon of oil"],
    "porridge": ["oats", "milk", "a pinch of salt", "sliced banana"],
}
STEPS = ["mix", "stir", "heat", "pour", "wait", "taste", "chop", "fold", "serve"]
GREETINGS = ["Hello", "Bonjour", "Hola", "Olá", "Hallo", "Ciao", "你好", "早上好"]
TOOLS = ["hammer", "saw", "drill", "brush", "spade", "ladder", "rake", "sponge"]


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    pet = rng.choice(ANIMALS)
    day = rng.choice(DAYS)
    shop = rng.choice(SHOPS)
    item = rng.choice(ITEMS)
    lines = [
        f"{name} lived in {rng.choice(PLACES)} with a {rng.choice(COLOURS)} {pet}.",
        f"Every {day}, {name} walked to the {shop} to buy {item}.",
        f"On the way, {name} met {friend}, who said, \"It's a fine day, isn't it?\"",
        f"\"It is,\" said {name}. \"I'm going to the {shop}. Do you want to come?\"",
        f"They walked together and talked about the {rng.choice(ANIMALS)} they'd seen by the road.",
        f"When {name} got home, the {pet} was waiting by the door, and {name} felt {rng.choice(FEELINGS)}.",
    ]
    keep = rng.randint(3, len(lines))
    return " ".join(lines[:keep])


def recipe(rng: random.Random) -> str:
    dish, ingredients = rng.choice(sorted(DISHES.items()))
    minutes = rng.choice([5, 10, 12, 15, 20, 25, 30, 45])
    steps = rng.sample(STEPS, 4)
    lines = [f"How to make {dish}", "", "You will need:"]
    lines += [f"- {ing}" for ing in ingredients]
    lines += ["", "Steps:"]
    lines += [f"{i + 1}. {s.capitalize()} for about {rng.randint(1, 9)} minutes." for i, s in enumerate(steps)]
    lines += ["", f"The whole recipe takes {minutes} minutes and serves {rng.randint(1, 6)}."]
    return "\n".join(lines)


def weather(rng: random.Random) -> str:
    city = rng.choice(CITIES)
    low = rng.randint(-5, 18)
    high = low + rng.randint(3, 14)
    rain = rng.randint(0, 100)
    return (
        f"Weather for {city} on {rng.choice(DAYS)}: the sky will be {rng.choice(SKIES)}. "
        f"Temperatures range from {low} to {high} degrees, with a {rain}% chance of rain. "
        f"Wind from the {rng.choice(['north', 'south', 'east', 'west'])} at {rng.randint(2, 40)} km/h."
    )


def arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 7)):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["plus", "times", "minus"])
        value = a + b if op == "plus" else a * b if op == "times" else a - b
        facts.append(f"{a} {op} {b} is {value}.")
    big = rng.randint(10**6, 10**9)
    facts.append(f"The number {big} has {len(str(big))} digits.")
    return " ".join(facts)


def code_snippet(rng: random.Random) -> str:
    fn = rng.choice(["add", "scale", "clamp", "average", "count_words"])
    arg = rng.choice(["x", "value", "n", "items"])
    k = rng.randint(2, 9)
    bodies = {
        "add": f"    return {arg} + {k}",
        "scale": f"    return {arg} * {k}",
        "clamp": f"    if {arg} > {k}:\n        return {k}\n    return {arg}",
        "average": f"    total = sum({arg})\n    return total / len({arg})",
        "count_words": f"    words = {arg}.split()\n    return len(words)",
    }
    return (
        f"Here is a small Python function called {fn}:\n\n"
        f"def {fn}({arg}):\n{bodies[fn]}\n\n"
        f"It is short, and it's easy to test."
    )


def letter(rng: random.Random) -> str:
    sender, receiver = rng.sample(NAMES, 2)
    tool = rng.choice(TOOLS)
    return (
        f"Dear {receiver},\n\n"
        f"Thank you for lending me your {tool}. I've finished the shelves, and they're straight at last. "
        f"I'll bring it back on {rng.choice(DAYS)} with a jar of {rng.choice(['honey', 'jam', 'pickles'])}.\n\n"
        f"Best wishes,\n{sender}"
    )


def greetings(rng: random.Random) -> str:
    chosen = rng.sample(GREETINGS, 4)
    name = rng.choice(NAMES)
    return f"{name} learned to say hello in four ways: " + ", ".join(chosen) + f". {name} liked the last one best."


FACTS = [
    ("water", "boils at 100 degrees Celsius at sea level and freezes at 0 degrees"),
    ("the Moon", "goes around the Earth about once every 27 days"),
    ("a spider", "has eight legs, while an insect has six"),
    ("light", "travels about 300,000 kilometres every second"),
    ("a leap year", "has 366 days, one more than a common year"),
    ("plants", "use sunlight, water and air to make their own food"),
    ("sound", "moves faster through water than through air"),
    ("a triangle", "has three sides, and its angles add up to 180 degrees"),
    ("the heart", "pumps blood around the body all day and all night"),
    ("bees", "carry pollen from flower to flower and make honey"),
]


def explainer(rng: random.Random) -> str:
    picked = rng.sample(FACTS, rng.randint(2, 4))
    teacher = rng.choice(NAMES)
    lines = [f"In today's lesson, {teacher} explained a few simple facts."]
    lines += [f"{subject[0].upper() + subject[1:]} {fact}." for subject, fact in picked]
    lines.append(f"The class asked {rng.randint(2, 12)} questions, and everyone wrote the facts down.")
    return " ".join(lines)


def dialogue(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice([i for i in ITEMS if not i.startswith("a ")])
    shop = rng.choice(SHOPS)
    price = rng.randint(1, 20)
    return "\n".join([
        f"{a}: Good morning! Do you have any {item} today?",
        f"{b}: We do. It's {price} euros, or {price * 2 - 1} for two.",
        f"{a}: I'll take two, please. Is the {shop} open on {rng.choice(DAYS)}?",
        f"{b}: Yes, from {rng.randint(7, 10)} in the morning until {rng.randint(4, 8)} in the evening.",
        f"{a}: Thanks, see you then!",
    ])


def diary(rng: random.Random) -> str:
    day = rng.choice(DAYS)
    pet = rng.choice(ANIMALS)
    feeling = rng.choice(FEELINGS)
    return (
        f"{day}, {rng.randint(1, 28)} {rng.choice(['March', 'June', 'September', 'December'])}\n"
        f"Today I woke up early and fed the {pet}. The weather was {rng.choice(SKIES)}, "
        f"so I {rng.choice(['read a book', 'cleaned the kitchen', 'fixed the gate', 'wrote letters'])} "
        f"and later went to the {rng.choice(SHOPS)}. I feel {feeling} tonight."
    )


TEXT_KINDS = [story, story, recipe, weather, arithmetic, code_snippet, letter, greetings, explainer, dialogue, diary]

# --- HellaSwag-style items ------------------------------------------------------------------------

ACTIVITIES = {
    "Baking cookies": (
        "{p} takes a tray out of the cupboard and lines it with paper. {P2} drops spoonfuls of dough",
        ["onto the tray, leaving space between them, and slides it into the oven.",
         "onto the paper in neat rows and sets a timer for twelve minutes."],
    ),
    "Washing a car": (
        "{p} fills a bucket with warm soapy water and parks the car in the shade. {P2} dips a sponge",
        ["into the bucket and scrubs the roof before rinsing it with the hose.",
         "in the water and washes the doors one by one, working from top to bottom."],
    ),
    "Painting a fence": (
        "{p} stirs a tin of white paint and lays old sheets along the grass. {P2} loads the brush",
        ["and paints the first plank with long, even strokes.",
         "and starts at the corner post, covering each board carefully."],
    ),
    "Playing the piano": (
        "{p} sits down at the piano and opens a book of songs. {P2} places both hands",
        ["on the keys and begins to play a slow tune.",
         "over the keys, takes a breath and plays the first chord."],
    ),
    "Planting a tree": (
        "{p} digs a deep hole in the garden and loosens the soil at the bottom. {P2} lifts the young tree",
        ["into the hole, fills it with soil and waters it well.",
         "out of its pot and sets it upright in the middle of the hole."],
    ),
    "Tying shoelaces": (
        "A child sits on the bottom step and pulls on a pair of trainers. The child crosses the laces",
        ["and makes two loops, then pulls them tight into a bow.",
         "over each other, pulls them snug and ties a double knot."],
    ),
    "Making tea": (
        "{p} fills the kettle and waits for the water to boil. {P2} pours the hot water",
        ["over a tea bag in a mug and lets it steep for three minutes.",
         "into the teapot and puts the lid on to keep it warm."],
    ),
    "Riding a bike": (
        "{p} puts on a helmet and wheels the bike out of the shed. {P2} climbs on",
        ["and pedals down the lane, ringing the bell at the corner.",
         "the saddle, pushes off and rides slowly along the path."],
    ),
    "Folding laundry": (
        "{p} tips a basket of clean clothes onto the bed. {P2} picks up a shirt",
        ["and folds the sleeves behind it before folding it in half.",
         "and smooths it flat, then folds it and adds it to the pile."],
    ),
    "Building a sandcastle": (
        "Two children kneel on the wet sand with a bucket and a spade. The older one packs the bucket",
        ["with damp sand, turns it over and lifts it to leave a tower.",
         "tightly with sand and flips it to make the first tower of the castle."],
    ),
    "Changing a light bulb": (
        "{p} switches off the lamp and waits for the old bulb to cool. {P2} unscrews the bulb",
        ["and screws in a new one, then switches the lamp back on.",
         "carefully and drops it into a box before fitting the new bulb."],
    ),
    "Walking a dog": (
        "{p} clips a lead onto the dog's collar and opens the front door. {P2} walks",
        ["the dog to the park and lets it sniff around the trees.",
         "along the pavement while the dog trots happily beside them."],
    ),
}
PRONOUNS = ["She", "He"]


def hellaswag_item(rng: random.Random, index: int, split: str = "train") -> dict:
    labels = sorted(ACTIVITIES)
    activity = rng.choice(labels)
    template, endings = ACTIVITIES[activity]
    person = rng.choice(NAMES)
    pronoun = rng.choice(PRONOUNS)
    ctx_full = template.format(p=person, P2=pronoun)
    # ctx_a is the first sentence, ctx_b the lower-cased start of the second (as in the public data).
    ctx_a, ctx_b = ctx_full.split(". ", 1)
    ctx_a += "."
    ctx_b = ctx_b[0].lower() + ctx_b[1:]
    correct = rng.choice(endings)
    # Distractors are endings of other activities: fluent but wrong for this context.
    others = [e for a in labels if a != activity for e in ACTIVITIES[a][1]]
    distractors = rng.sample(others, 3)
    label = rng.randrange(4)
    choices = distractors[:label] + [correct] + distractors[label:]
    return {
        "ind": index,
        "activity_label": activity,
        "ctx_a": ctx_a,
        "ctx_b": ctx_b,
        "ctx": f"{ctx_a} {ctx_b}",
        "endings": choices,
        "source_id": f"titan_kimi-sample~{index}",
        "split": split,
        "split_type": "indomain",
        "label": str(label),
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args()

    rng = random.Random(SEED)
    texts = [{"text": rng.choice(TEXT_KINDS)(rng)} for _ in range(NUM_TEXT_DOCS)]
    write_jsonl(args.out_dir / "sample_text.jsonl", texts)

    rng = random.Random(SEED + 1)
    items = [hellaswag_item(rng, i) for i in range(NUM_HELLASWAG_ITEMS)]
    write_jsonl(args.out_dir / "sample_hellaswag.jsonl", items)

    # Validation splits hold no document (no HellaSwag context) that the training files hold.
    rng, seen, val_texts = random.Random(SEED + 2), {t["text"] for t in texts}, []
    while len(val_texts) < NUM_TEXT_VALIDATION_DOCS:
        text = rng.choice(TEXT_KINDS)(rng)
        if text not in seen:
            seen.add(text)
            val_texts.append({"text": text})
    write_jsonl(args.out_dir / "sample_text_validation.jsonl", val_texts)
    rng, seen, val_items = random.Random(SEED + 3), {i["ctx"] for i in items}, []
    while len(val_items) < NUM_HELLASWAG_VALIDATION_ITEMS:
        item = hellaswag_item(rng, NUM_HELLASWAG_ITEMS + len(val_items), split="val")
        if item["ctx"] not in seen:
            seen.add(item["ctx"])
            val_items.append(item)
    write_jsonl(args.out_dir / "sample_hellaswag_validation.jsonl", val_items)
    print(f"wrote {len(texts)} + {len(val_texts)} documents and {len(items)} + {len(val_items)} HellaSwag items "
          f"(train + validation) to {args.out_dir}")


if __name__ == "__main__":
    main()
