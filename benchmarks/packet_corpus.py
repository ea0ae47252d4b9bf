"""Training documents for the default model's shipped packet: short fictional encyclopedia
entries from templates (invented names and numbers, so nothing is recalled from pretraining),
each with questions about its own facts. A different corpus from the held-out fidelity cases
(tests/data/quality_heldout.jsonl, written by hand), which are never trained on.

    from benchmarks.packet_corpus import synthetic_cases
    items = synthetic_cases(120, seed=0)   # [{"question", "documents", "system", "doc_ids"}]
"""
from __future__ import annotations

import random

SYSTEMS = ("Answer the question in a few words, using only the documents.", "You are a helpful assistant.",
           "Use the documents to answer briefly.", None)

_SYL = ["bar", "ken", "dol", "mir", "tas", "vel", "orn", "lun", "gra", "set", "pol", "dra", "fen", "hal", "ros",
        "kir", "wen", "ab", "tor", "mel", "sun", "vik", "lar", "ost"]


def _name(rng: random.Random, parts=2) -> str:
    return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def _doc(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """A document and its (question, answer) pairs."""
    n1, n2, n3 = _name(rng), _name(rng), _name(rng, 3)
    y1, y2 = rng.randint(1700, 1990), rng.randint(1800, 2020)
    a, b, c = rng.randint(2, 95), rng.randint(100, 9000), rng.randint(3, 60)
    kind = rng.randrange(10)
    if kind == 0:
        return (f"The {n1} bridge crosses the river {n2} near the town of {n3}. It was opened in {y1} and is "
                f"{b} metres long. Trams stopped using it in {y2}, when a new tunnel was dug.",
                [(f"How long is the {n1} bridge?", f"{b} metres"), (f"When was the {n1} bridge opened?", str(y1))])
    if kind == 1:
        return (f"{n1} cheese is made in the valley of {n2} from the milk of goats. It ripens for {c} weeks in "
                f"caves and is rubbed with salt and ash. About {b} wheels are made each year.",
                [(f"How long does {n1} cheese ripen?", f"{c} weeks"), (f"What milk is {n1} cheese made from?",
                                                                      "goat milk")])
    if kind == 2:
        mat = rng.choice(["wood", "paper", "leather"])
        return (f"The {n1} festival is held every spring in {n2}. Dancers wear masks of painted {mat}, "
                f"and the procession lasts {c} hours. It was first recorded in {y1}.",
                [(f"How long does the {n1} procession last?", f"{c} hours"),
                 (f"When was the {n1} festival first recorded?", str(y1))])
    if kind == 3:
        metal = rng.choice(["zinc", "tin", "cobalt", "nickel"])
        died = y1 + rng.randint(40, 80)
        return (f"{n1} {n2} was a chemist born in {n3} in {y1}. She discovered that {metal} "
                f"salts glow under ultraviolet light and published {c} papers. She died in {died}.",
                [(f"Where was {n1} {n2} born?", n3), (f"How many papers did {n1} {n2} publish?", str(c))])
    if kind == 4:
        return (f"The {n1} line is a railway of {b} kilometres between {n2} and {n3}. The journey takes {c} hours "
                f"and trains leave every {rng.choice([15, 20, 30, 45, 60])} minutes. The line opened in {y1}.",
                [(f"How long is the {n1} line?", f"{b} kilometres"),
                 (f"How long does the journey from {n2} to {n3} take?", f"{c} hours")])
    if kind == 5:
        return (f"Lake {n1} lies at {b} metres above sea level in the {n2} hills. It is {a} metres deep at its "
                f"deepest point and freezes from {rng.choice(['December', 'January', 'November'])} to March.",
                [(f"How deep is Lake {n1}?", f"{a} metres"), (f"At what altitude does Lake {n1} lie?", f"{b} metres")])
    if kind == 6:
        return (f"At {n1} Robotics, employees may work from home {rng.randint(1, 4)} days a week. Laptops are "
                f"replaced every {rng.randint(2, 5)} years, and travel must be booked {c} days ahead through the "
                f"{n2} portal.", [(f"How far ahead must travel be booked at {n1} Robotics?", f"{c} days"),
                                  (f"Which portal does {n1} Robotics use for travel?", n2)])
    if kind == 7:
        return (f"The {n1} beetle lives only in the forests of {n2}. It grows to {c} millimetres and feeds on "
                f"the bark of {rng.choice(['oak', 'birch', 'pine', 'beech'])} trees. Its larvae hatch after {a} days.",
                [(f"Where does the {n1} beetle live?", f"the forests of {n2}"),
                 (f"How long does the {n1} beetle grow?", f"{c} millimetres")])
    if kind == 8:
        opens, closes, day = rng.randint(8, 11), rng.randint(4, 8), rng.choice(["Mondays", "Tuesdays"])
        return (f"The {n1} museum in {n2} holds {b} paintings, most of them landscapes. It is open from "
                f"{opens} a.m. to {closes} p.m. and closed on {day}. "
                f"Entry costs {c} crowns.", [(f"How many paintings does the {n1} museum hold?", str(b)),
                                              (f"How much does entry to the {n1} museum cost?", f"{c} crowns")])
    return (f"{n1} is a card game for {rng.randint(2, 6)} players, invented in {n2} in {y1}. Each player gets "
            f"{c} cards, and a round ends when the deck of {b} cards is empty.",
            [(f"How many cards does each {n1} player get?", str(c)), (f"Where was {n1} invented?", n2)])


def synthetic_cases(n: int, *, docs_per_case: int = 4, seed: int = 0, doc_offset: int = 0) -> list[dict]:
    """``n`` cases over a pool of ``n`` documents: each asks a question about one document,
    shown among ``docs_per_case - 1`` others in a random order. ``doc_ids`` names the
    documents (for a split by document)."""
    rng = random.Random(seed)
    docs = [_doc(rng) for _ in range(max(n, docs_per_case))]
    out = []
    for i in range(n):
        text, qas = docs[i % len(docs)]
        others = rng.sample([j for j in range(len(docs)) if j != i % len(docs)], docs_per_case - 1)
        ids = [i % len(docs)] + others
        rng.shuffle(ids)
        q, ans = rng.choice(qas)
        out.append(dict(question=q, documents=[docs[j][0] for j in ids], system=rng.choice(SYSTEMS),
                        reference=ans, doc_ids=[doc_offset + j for j in ids]))
    return out
