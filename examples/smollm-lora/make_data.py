"""Builds the example's instruction data from the bundled Moby-Dick.

Task: name the Pequod crew member a passage mentions. Every example is a
sentence of the novel that names exactly one of ten crew members; the user
asks who it mentions, the assistant answers with the name. The answer is in
the passage, so a small model can learn the format and the extraction and
apply them to sentences it never saw (the held-out file: every 10th example).

Provenance: data/moby-dick.txt (Herman Melville, 1851; public domain, see
data/README.md). Deterministic: the same corpus gives the same files.

    python3 examples/smollm-lora/make_data.py   # writes train.jsonl and heldout.jsonl beside this file
"""
import json
import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE.parent.parent / "data" / "moby-dick.txt"
CREW = ["Ahab", "Starbuck", "Stubb", "Flask", "Queequeg", "Ishmael", "Tashtego", "Daggoo", "Pip", "Fedallah"]
SYSTEM = "You answer questions about passages from Moby-Dick in one short sentence."


def sentences(text):
    text = re.sub(r"\s+", " ", text)
    for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", text):
        s = s.strip()
        if 40 <= len(s) <= 220:
            yield s


def main():
    examples = []
    for s in sentences(CORPUS.read_text(encoding="utf-8")):
        named = [c for c in CREW if re.search(rf"\b{c}\b", s)]
        if len(named) != 1:
            continue
        examples.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Which member of the Pequod's crew does this passage mention?\n\n{s}"},
                    {"role": "assistant", "content": f"It mentions {named[0]}."},
                ]
            }
        )
    heldout = examples[9::10]
    train = [e for i, e in enumerate(examples) if i % 10 != 9]
    for name, rows in [("train.jsonl", train), ("heldout.jsonl", heldout)]:
        with open(HERE / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(train)} train, {len(heldout)} held-out examples")


if __name__ == "__main__":
    main()
