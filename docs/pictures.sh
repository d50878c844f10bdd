#!/usr/bin/env bash
# Re-takes the documentation's pictures from real runs, by hand (a few minutes; not part of the suite):
# - the studio's tabs and the blind A/B tab: its browser test drives a real server through a whole session in
#   headless Chromium (upload a CSV, train, stop, resume, export, vote, chat) and screenshots each tab;
# - the compare report's charts: `tunebench report` on the reference study's own results table;
# - a run report's charts: the README's first command with --epochs 3, on the built-in sample's first 48 rows.
#   bash docs/pictures.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

TUNEBENCH_ARTIFACTS=$tmp $py -m pytest -q -p no:cacheprovider tests/test_studio.py -k a_browser_goes_from_a_csv
cp "$tmp/studio/train-data.png" docs/studio-data.png
cp "$tmp/studio/train-live.png" docs/studio-train.png
cp "$tmp/studio/runs.png" docs/studio-runs.png
cp "$tmp/studio/ab.png" docs/serve-ab.png

$py -m tunebench report src/tunebench/examples/study_results.csv -o "$tmp/study"
for chart in duration batch_effect; do cp "$tmp/study/$chart.png" "docs/pictures/study-$chart.png"; done

$py - "$tmp/my.csv" <<'PY'
import csv, json, sys
rows = [json.loads(line) for line in open("src/tunebench/data/sample/customer_support.jsonl")][:48]
with open(sys.argv[1], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["instruction", "response"])
    w.writerows([r["instruction"], r["response"]] for r in rows)
PY
(cd "$tmp" && "$OLDPWD/$py" -m tunebench train --data my.csv --output-dir runs/my-model --epochs 3)
$py -m tunebench report "$tmp/runs/my-model" -o "$tmp/run-report"
ls "$tmp/run-report"
for chart in "$tmp"/run-report/*/*.png "$tmp"/run-report/*.png; do
  [[ -f $chart ]] && cp "$chart" "docs/pictures/run-$(basename "$chart")"
done
echo "pictures written under docs/ and docs/pictures/"
