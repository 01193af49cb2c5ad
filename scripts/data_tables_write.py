#!/usr/bin/env python3
"""Fine-tuning tables as Hugging Face `datasets` and pyarrow write them.

Writes into OUT, for each schema (text, messages, alpaca, sharegpt,
prompt_completion with strings and with messages), the same rows three
ways: `NAME.jsonl` (`Dataset.to_json`, the reference the Rust test reads
with the JSON Lines reader), `NAME.parquet` (`Dataset.to_parquet`:
pyarrow's default codec, snappy) and `NAME_disk/` (`Dataset.save_to_disk`:
Arrow IPC streams, `state.json`, `dataset_info.json`). Besides them:
`large.arrow` (an IPC stream of large_string / large_list columns written
by pyarrow itself), `gzip.parquet`, `zstd.parquet` (a codec this build
does not decode), `columns.parquet` (columns of no schema) and `dict_disk/`
(a DatasetDict).

    python3 scripts/data_tables_write.py OUT

Needs `pip install datasets pyarrow`.
"""

import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict

# the questions, contexts and answers the JSON Lines check trains on
from data_schemas_check import QA, user_text

def rows():
    user = user_text
    chats = [[{"role": "user", "content": user(i, c)}, {"role": "assistant", "content": a}] for i, c, a in QA]
    return {
        "text": [{"text": f"Q: {user(i, c)}\nA: {a}"} for i, c, a in QA],
        "messages": [{"messages": c} for c in chats],
        # "input" absent on some rows: a null cell
        "alpaca": [{"instruction": i, "output": a} | ({"input": c} if c else {}) for i, c, a in QA],
        "sharegpt": [
            {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in c]}
            for c in chats
        ],
        "prompt_completion": [{"prompt": f"Q: {user(i, c)}\nA:", "completion": f" {a}"} for i, c, a in QA],
        "prompt_completion_chat": [{"prompt": c[:-1], "completion": c[-1:]} for c in chats],
    }


def main():
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    datasets.disable_progress_bars()
    for name, data in rows().items():
        ds = Dataset.from_list(data)
        ds.to_json(str(out / f"{name}.jsonl"))
        ds.to_parquet(str(out / f"{name}.parquet"))
        ds.save_to_disk(str(out / f"{name}_disk"))
    msgs = rows()["messages"]
    msg_type = pa.large_list(pa.struct([("role", pa.large_string()), ("content", pa.large_string())]))
    table = pa.table({"id": pa.array(range(len(msgs)), pa.int64()), "messages": pa.array([r["messages"] for r in msgs], msg_type)})
    with pa.ipc.new_stream(str(out / "large.arrow"), table.schema) as w:
        # two record batches: rows continue across them
        for batch in table.to_batches(max_chunksize=4):
            w.write_batch(batch)
    pq.write_table(table, str(out / "gzip.parquet"), compression="gzip")
    pq.write_table(table, str(out / "zstd.parquet"), compression="zstd")
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), str(out / "columns.parquet"))
    DatasetDict({"train": Dataset.from_list(msgs), "test": Dataset.from_list(msgs[:2])}).save_to_disk(str(out / "dict_disk"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
