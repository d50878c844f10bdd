"""The 240 judgements ab.sh trains KTO on: Bitext rows (seeded shuffle), every other one's completion another row's
response (label false)."""
import csv
import json
import random

rows = list(csv.DictReader(open("../shared/data/bitext-early-official-4514rows/"
                                "Bitext_Sample_Customer_Support_Training_Dataset.csv")))
random.seed(0)
random.shuffle(rows)
rows = rows[:240]
with open("judged.jsonl", "w") as out:
    for i, r in enumerate(rows):
        good = i % 2 == 0
        completion = r["response"] if good else rows[(i + 7) % len(rows)]["response"]
        out.write(json.dumps({"prompt": r["instruction"], "completion": completion, "label": good}) + "\n")
