"""Writes examples/smollm-dpo/pairs.jsonl: 128 preference pairs in TRL's
conversational format ({"prompt": [messages], "chosen": [assistant],
"rejected": [assistant]}) from the LoRA example's chats. The chosen reply is
the chat's own answer, the rejected one another chat's (a different answer).
Deterministic; run from the repository root."""
import json

rows = [json.loads(line) for line in open("examples/smollm-lora/train.jsonl")]
out = []
for i in range(128):
    messages = rows[i]["messages"]
    reply = messages[-1]["content"]
    j = (i * 7 + 3) % len(rows)
    while rows[j]["messages"][-1]["content"] == reply:
        j = (j + 1) % len(rows)
    other = rows[j]["messages"][-1]["content"]
    out.append({
        "prompt": messages[:-1],
        "chosen": [{"role": "assistant", "content": reply}],
        "rejected": [{"role": "assistant", "content": other}],
    })
with open("examples/smollm-dpo/pairs.jsonl", "w") as f:
    f.writelines(json.dumps(o) + "\n" for o in out)
