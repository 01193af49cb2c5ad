#!/usr/bin/env bash
# The destructive cases of a hostile user, re-run end to end against the
# release binary; prints each case's command, exit code and message.
# (The same properties are asserted by tests/run_folder.rs,
# tests/plan_limits.rs and tests/data_reliability.rs; this is the long form,
# for reports.)
#
#   scripts/hostile-cases.sh [WORKDIR]      # default: a fresh temp folder
set -uo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q || exit 1
bin="$PWD/target/release/macrobatch"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
cd "$work" || exit 1
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)   workdir: $work"
tiny=(--set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 --set model.block_size=32
      --set batch.micro=4 --set batch.accumulation_steps=2 --set train.eval_every=0 --set train.threads=1)
# The exit code and the error line (else the last line) of a command's stderr.
show() { echo "  exit $1: $( (grep -m1 '^error' "$2" || tail -n1 "$2") | cut -c1-420)"; }
rss_mib() { echo $(( $(tail -n1 rss.txt) / 1024 )); }

echo "== 1. --out on a folder holding the user's files"
rm -rf d && mkdir d && for f in plot.svg config.json memory.json; do echo mine > "d/$f"; done
"$bin" train "${tiny[@]}" --set train.steps=1 --out d 2>err.txt; show $? err.txt
echo "  contents after: $(cat d/plot.svg d/config.json d/memory.json | tr '\n' ' ')"

echo "== 2. a second process on a running run folder (then kill -9 the first)"
rm -rf cc
"$bin" train "${tiny[@]}" --set train.steps=100000 --set train.checkpoint_every=1 --out cc 2>/dev/null &
first=$!
until [[ -s cc/metrics.jsonl ]]; do sleep 0.1; done
"$bin" train --resume cc --set optim.lr=1e-3 --stop-after 1 2>err.txt; show $? err.txt
"$bin" train "${tiny[@]}" --set train.steps=1 --out cc 2>err.txt; show $? err.txt
kill -9 "$first"; wait "$first" 2>/dev/null
"$bin" train --resume cc --stop-after 1 2>err.txt; show $? err.txt

echo "== 3. near the memory limit: GPT-2 small, micro 8, global 16 (a checkpoint first, then resumes under ulimit -v)"
rm -rf big
small=(--set model.preset=small --set batch.micro=8 --set batch.global=16 --set train.eval_every=0 --set train.checkpoint_every=1)
"$bin" train "${small[@]}" --set train.steps=1 --out big 2>err.txt; show $? err.txt
before=$(find big/checkpoints/step-00000001 -type f -exec sha256sum {} + | sort | sha256sum)
for kib in 2260000 2600000 3000000; do
  (ulimit -v "$kib"; "$bin" train --resume big --set train.steps=2 2>err.txt); code=$?
  echo " ulimit -v $kib:"; show $code err.txt
done
after=$(find big/checkpoints/step-00000001 -type f -exec sha256sum {} + | sort | sha256sum)
[[ "$before" == "$after" ]] && echo "  step 1's checkpoint files unchanged (sha256)" || echo "  STEP 1'S CHECKPOINT CHANGED"

echo "== 4. plan on absurd shapes (peak RSS)"
for s in "model.n_layer=10000000" "model.n_embd=1000000000" "model.n_layer=5461" ; do
  /usr/bin/time -f "%M" -o rss.txt "$bin" plan --set "$s" >out.txt 2>err.txt; code=$?
  echo "  plan --set $s: exit $code, peak RSS $(rss_mib) MiB; $( (grep -m1 '^error' err.txt || echo 'a plan') | cut -c1-200)"
done
/usr/bin/time -f "%M" -o rss.txt "$bin" train --set model.n_layer=1000000000 --out never 2>err.txt; code=$?
echo "  train --set model.n_layer=1000000000: exit $code, peak RSS $(rss_mib) MiB, folder created: $([[ -e never ]] && echo yes || echo no)"

echo "== 5. a token file truncated while training"
rm -rf tok run5 && "$bin" prepare "$OLDPWD/data/moby-dick.txt" --tokenizer byte --out tok >/dev/null 2>&1
"$bin" train "${tiny[@]}" --set data.format=u16 --set data.path=tok/train.bin --set data.val_path=tok/val.bin \
  --set train.steps=100000 --set train.log_every=1 --out run5 2>err.txt &
pid=$!
until [[ -s run5/metrics.jsonl ]]; do sleep 0.1; done
truncate -s 4096 tok/train.bin
wait "$pid"; show $? err.txt

echo "== 6. a file prepare wrote, data.format forgotten (train must read tokens, as eval does)"
rm -rf run6 run6u
"$bin" train "${tiny[@]}" --set data.path=tok/train.bin --set data.val_path=tok/val.bin --set train.steps=2 --out run6 2>err.txt; show $? err.txt
"$bin" train "${tiny[@]}" --set data.format=u16 --set data.path=tok/train.bin --set data.val_path=tok/val.bin --set train.steps=2 --out run6u 2>/dev/null
cmp -s <(grep -o '"loss":[^,]*' run6/metrics.jsonl) <(grep -o '"loss":[^,]*' run6u/metrics.jsonl) \
  && echo "  losses equal to data.format = u16's" || echo "  LOSSES DIFFER from data.format = u16's"
grep -m1 '^note' err.txt | cut -c1-200 | sed 's/^/  /'

echo "== 7. export RUN --out PARENT --force (PARENT holds the run, its siblings and the user's files)"
rm -rf par && mkdir -p par && echo mine > par/notes.txt
"$bin" train "${tiny[@]}" --set train.steps=1 --out par/run 2>/dev/null
"$bin" train "${tiny[@]}" --set train.steps=1 --out par/sibling 2>/dev/null
"$bin" export par/run --format hf --out par --force 2>err.txt; show $? err.txt
echo "  left in par: $(ls par | tr '\n' ' ')"

echo "== 8. two exports to one path at once, then a second one without --force"
rm -f race.gguf
"$bin" export par/run --format gguf --out race.gguf 2>err1.txt & a=$!
"$bin" export par/run --format gguf --out race.gguf 2>err2.txt & b=$!
wait $a; ca=$?; wait $b; cb=$?
echo "  exits $ca and $cb"; show $ca err1.txt; show $cb err2.txt
before=$(sha256sum < race.gguf)
"$bin" export par/sibling --format gguf --out race.gguf 2>err.txt; show $? err.txt
[[ "$before" == "$(sha256sum < race.gguf)" ]] && echo "  race.gguf unchanged" || echo "  RACE.GGUF REPLACED"
ls -a . | grep -E '\.part|\.lock' | sed 's/^/  left over: /'

echo "== 9. --out on a folder with a run_id that is not ours, beside the user's files"
rm -rf rid && mkdir rid && echo "experiment 7" > rid/run_id && echo '{"mine":1}' > rid/tokenizer.json && echo '{}' > rid/memory.json
"$bin" train "${tiny[@]}" --set train.steps=1 --out rid 2>err.txt; show $? err.txt
echo "  contents after: $(cat rid/run_id rid/tokenizer.json rid/memory.json | tr '\n' ' ')"

echo "== 10. fidelity: SmolLM2-135M (the GGUF of scripts/fetch-smollm.sh; skipped without it)"
gguf="${MACROBATCH_SMOLLM_GGUF:-$("$OLDPWD/scripts/fetch-smollm.sh" 2>/dev/null)}"
if [[ -s "$gguf" ]]; then
  printf 'The cat' > two.txt
  ours=$("$bin" eval "$gguf" --data two.txt --seq-len 1 2>err.txt | awk '/^loss/ {print $2}')
  ref=$(python3 - "$gguf" 2>/dev/null <<'PY'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f = os.path.split(sys.argv[1])
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float64)
ids = torch.tensor([tok.encode("The cat", add_special_tokens=False)])
print(f"{model(ids, labels=ids).loss.item():.7f}")
PY
)
  echo "  eval --seq-len 1 on 'The cat' (one prediction): ours ${ours:-failed: $(tail -n1 err.txt)}, transformers in f64 ${ref:-(not run: pip install torch transformers gguf)}"
  "$bin" generate "$gguf" --prompt "<|im_start|>user
What is 2+2?<|im_end|>
<|im_start|>assistant
" --max-new-tokens 200 >gen.txt 2>err.txt; code=$?
  echo "  generate without --chat (200 new tokens at most): exit $code, $(wc -c <gen.txt) bytes; turns begun after the prompt's two: $(( $(grep -o 'im_start' gen.txt | wc -l) - 2 ))"
else
  echo "  no SmolLM2 GGUF (run scripts/fetch-smollm.sh): skipped"
fi

echo "== 11. a run started from a model folder records the folder's shape, not a preset"
rm -rf run11
"$bin" train "${tiny[@]}" --init-from par/run --set train.steps=1 --out run11 2>err.txt; show $? err.txt
echo "  config.resolved.toml: $(grep -E '^(preset|n_layer|n_embd) ' run11/config.resolved.toml | tr '\n' ' ')"

echo "== 12. one 50 MB JSONL line, cut to data.seq_len = 32 (GPT-2's BPE): seconds and peak RSS"
python3 -c "
import json, random
random.seed(0)
words = open('$OLDPWD/data/moby-dick.txt').read().split()
text = ' '.join(words[i % len(words)] for i in range(9_000_000))[:50_000_000]
open('huge.jsonl', 'w').write(json.dumps({'text': text}) + '\n' + ''.join(json.dumps({'text': f'short line {i}'}) + '\n' for i in range(19)))
"
rm -rf run12
start=$SECONDS
/usr/bin/time -f "%M" -o rss.txt "$bin" train "${tiny[@]}" --set data.format=jsonl --set data.path=huge.jsonl \
  --set model.vocab_size=50257 --set data.tokenizer=gpt2 --set data.seq_len=32 --set train.steps=1 --out run12 2>err.txt; code=$?
echo "  exit $code in $((SECONDS - start)) s, peak RSS $(rss_mib) MiB; $(grep -m1 'cut to' err.txt | cut -c1-160)"
