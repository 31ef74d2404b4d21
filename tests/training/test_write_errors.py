"""A disk that fills while a run writes: the first training checkpoint, an exported model, a GGUF
import, a lookup corpus, decoding.json, self-generated data. Each ends in one line naming the file (no traceback) and
leaves no half-written file or directory under its name. On a small tmpfs, or the same failure
monkeypatched where no tmpfs can be mounted (tests/helpers/full_disk.py)."""

from __future__ import annotations

import json

import pytest

from refusion.cli import main
from refusion.decoding import model_settings
from refusion.decoding.corpus import write_corpus
from refusion.files import WriteError
from refusion.model.checkpoint import save_model
from refusion.model.gguf import import_gguf
from refusion.training.self_generate import Prompt, self_generate
from tests.helpers.bundled import bundled
from tests.helpers.full_disk import full_disk
from tests.helpers.tiny_gguf import write_byte_level_gguf
from tests.helpers.train_helpers import TINY, doubling_file

pytestmark = pytest.mark.usefixtures("one_thread")
FULL = "No space left on device (the disk is full: free some space or write somewhere else)"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return doubling_file(tmp_path_factory)


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "patched"])
@pytest.mark.parametrize("size_kb, fails", [(256, "checkpoint-1"), (8, "tokenizer")])
def test_a_disk_that_fills_at_the_first_checkpoint_is_one_line(data_file, tmp_path, monkeypatch, capsys, real,
                                                               size_kb, fails):
    with full_disk(tmp_path, monkeypatch, size_kb=size_kb, real=real) as disk:
        out = disk.path / "run"
        argv = ["train", f"--data={data_file}", "--set=vocab_size=300", f"--set=model={json.dumps(TINY)}",
                "--set=batch_size=8", "--max-steps=1", f"--out={out}", "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        errors = [ln for ln in err.splitlines() if ln.startswith("refusion: error:")]
        assert errors == [f"refusion: error: could not write {out / fails}: {FULL}"], err
        assert "Traceback" not in err and "SafetensorError" not in err
        assert not out.exists()  # a run that fails before its first checkpoint leaves nothing behind
        assert [p.name for p in disk.path.iterdir()] == []


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "patched"])
def test_exports_corpora_and_settings_on_a_full_disk(tmp_path, monkeypatch, real):
    model, tok = bundled()
    with full_disk(tmp_path, monkeypatch, size_kb=128, real=real) as disk:
        target = disk.path / "export"
        with pytest.raises(WriteError, match=f"could not write {target}: No space left"):
            save_model(model, target, tok)
        assert list(disk.path.iterdir()) == []  # no half-written directory, no temporary one
        gguf_file = tmp_path / "tiny.gguf"
        write_byte_level_gguf(gguf_file)
        with pytest.raises(WriteError, match=f"could not write {disk.path / 'imported'}: No space left"):
            import_gguf(gguf_file, disk.path / "imported")
        assert list(disk.path.iterdir()) == []
    with full_disk(tmp_path, monkeypatch, size_kb=64, real=real) as disk:
        # a lookup corpus too large for the room left, then decoding.json: the old files stay whole
        model_settings.write(disk.path, model_settings.ModelSettings("ar", {"gen_length": 32}))
        before = (disk.path / model_settings.FILE).read_bytes()
        with pytest.raises(WriteError, match="lookup_corpus.safetensors: No space left"):
            write_corpus(disk.path, [list(range(100))] * 1000)
        with pytest.raises(WriteError, match="decoding.json: No space left"):
            model_settings.write(disk.path, model_settings.ModelSettings(
                "speculative", {"gen_length": 32}, note="x" * 200_000))
        assert (disk.path / model_settings.FILE).read_bytes() == before
        assert sorted(p.name for p in disk.path.iterdir()) == [model_settings.FILE]


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "patched"])
def test_self_generate_on_a_full_disk_keeps_whole_lines_and_resumes(tmp_path, monkeypatch, real):
    model, tok = bundled()
    prompts = [Prompt("jsonl", f"Add: {i} + {i}" + " pad" * 150) for i in range(10)]  # long queries fill it fast
    with full_disk(tmp_path, monkeypatch, size_kb=4, real=real) as disk:
        out = disk.path / "data.jsonl"
        with pytest.raises(WriteError, match=f"could not write {out}: No space left"):
            self_generate(model, tok, prompts, out, max_tokens=8, batch_size=2, progress=False)
        kept = [json.loads(x) for x in out.read_text().splitlines()]  # every line whole
        assert 0 < len(kept) < len(prompts) and out.read_text().endswith("\n")
    # the same command where there is room goes on from them
    full = tmp_path / "data.jsonl"
    full.write_text("".join(json.dumps(r) + "\n" for r in kept))
    counts = self_generate(model, tok, prompts, full, max_tokens=8, batch_size=2, progress=False)
    assert counts["skipped"] == len(kept) and counts["written"] == len(prompts) - len(kept)
    assert sorted(json.loads(x)["query"] for x in full.read_text().splitlines()) == sorted(p.query for p in prompts)


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    from refusion.training.run_dir import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.2}\n{"step": 4, "lo')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
