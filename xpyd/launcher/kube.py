"""A Deployment's replicas through the Kubernetes API's scale subresource, from inside a pod (aiohttp, no client
library).

    GET   {api}/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale  -> a Scale: spec.replicas
    PATCH (the same path), Content-Type application/merge-patch+json, {"spec": {"replicas": n}}  -> the new Scale

In a pod (``KubeConfig.in_cluster``): the API server at https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT,
verified with the service account's CA; the service account's token, read again before each call (the kubelet
rotates it). The RBAC it needs: get and patch on deployments/scale of the Deployments it names (the chart's Role
names exactly the prefill and decode Deployments). Every call has a timeout; any failure (no answer, a refusal,
an answer that is not a Scale) is a ``KubeError`` saying what was asked and what came back.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec

from xpyd.netaddr import host_port

__all__ = ["KubeConfig", "KubeError", "ScaleClient", "SERVICE_ACCOUNT_DIR"]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
MAX_REPLY_BYTES = 1 << 20
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class KubeError(RuntimeError):
    """A call to the Kubernetes API failed."""


@dataclass(frozen=True, slots=True)
class KubeConfig:
    api_url: str  # https://HOST:PORT (http:// only for a test's fake server)
    namespace: str
    token_file: Path
    ca_file: Path | None = None  # None: the system's CAs
    timeout_s: float = 5.0  # any one call

    def __post_init__(self) -> None:
        if not self.api_url.startswith(("https://", "http://")):
            raise ValueError(f"the Kubernetes API URL must be https://HOST:PORT, got {self.api_url!r}")
        if not _DNS_LABEL.fullmatch(self.namespace):
            raise ValueError(f"not a Kubernetes namespace: {self.namespace!r}")
        if not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 300):
            raise ValueError(f"the Kubernetes API timeout must be in (0, 300] s, got {self.timeout_s!r}")

    @classmethod
    def in_cluster(cls, namespace: str | None = None, timeout_s: float = 5.0,
                   environ: Mapping[str, str] = os.environ, account: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
        """The API server and credentials a pod has; ValueError when this is not a pod that has them."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port or not port.isdigit():
            raise ValueError("not in a Kubernetes pod: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are unset")
        token, ca = account / "token", account / "ca.crt"
        if not token.is_file() or not ca.is_file():
            raise ValueError(f"no service account token and CA in {account} (automountServiceAccountToken off?)")
        if namespace is None:
            try:
                namespace = (account / "namespace").read_text().strip()
            except OSError as e:
                raise ValueError(f"the pod's namespace is unknown ({e}): give --namespace") from None
        return cls(f"https://{host_port(host, int(port))}", namespace, token, ca, timeout_s)


def check_name(name: str, what: str) -> str:
    """``name`` if it can name a Deployment; ValueError saying ``what`` is wrong otherwise."""
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise ValueError(f"{what} is not a Kubernetes object name: {name!r}")
    return name


class _ScaleSpec(msgspec.Struct, frozen=True):
    replicas: int = 0  # (omitted when 0)


class _Scale(msgspec.Struct, frozen=True):
    kind: str
    spec: _ScaleSpec = _ScaleSpec()


class _Status(msgspec.Struct, frozen=True):  # what the API server says when it refuses
    message: str = ""
    reason: str = ""


class ScaleClient:
    """The replicas of Deployments in one namespace; ``open`` before the first call, ``close`` after the last."""

    def __init__(self, config: KubeConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        c = self.config
        tls = ssl.create_default_context(cafile=str(c.ca_file)) if c.ca_file is not None else None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=c.timeout_s),
            connector=aiohttp.TCPConnector(ssl=tls if tls is not None else True, limit=4))

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def replicas(self, deployment: str) -> int:
        """The Deployment's desired replicas (spec.replicas of its scale)."""
        return await self._call("GET", deployment, None)

    async def scale(self, deployment: str, replicas: int) -> int:
        """Set the Deployment's replicas; what the API server answers they are now."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
        return await self._call("PATCH", deployment, msgspec.json.encode({"spec": {"replicas": replicas}}))

    async def _call(self, method: str, deployment: str, body: bytes | None) -> int:
        if self._session is None:
            raise RuntimeError("ScaleClient.open() first")
        c = self.config
        path = f"/apis/apps/v1/namespaces/{c.namespace}/deployments/{deployment}/scale"
        what = f"{method} {path}"
        try:
            token = c.token_file.read_text().strip()
        except OSError as e:
            raise KubeError(f"{what}: no service account token ({e})") from None
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
        try:
            async with self._session.request(method, c.api_url + path, data=body, headers=headers,
                                             allow_redirects=False) as r:
                status, reply = r.status, await r.content.read(MAX_REPLY_BYTES + 1)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise KubeError(f"{what}: {type(e).__name__}: {str(e) or f'no answer within {c.timeout_s:g}s'}") from None
        if len(reply) > MAX_REPLY_BYTES:
            raise KubeError(f"{what}: an answer over {MAX_REPLY_BYTES} bytes")
        if status != 200:
            raise KubeError(f"{what}: HTTP {status}{_refusal(status, reply)}")
        try:
            scale = msgspec.json.decode(reply, type=_Scale)
        except msgspec.DecodeError as e:
            raise KubeError(f"{what}: not a Scale ({e})") from None
        if scale.kind != "Scale" or scale.spec.replicas < 0:
            raise KubeError(f"{what}: not a Scale (kind {scale.kind!r}, replicas {scale.spec.replicas})")
        return scale.spec.replicas


def _refusal(status: int, reply: bytes) -> str:
    try:
        s = msgspec.json.decode(reply, type=_Status)
        said = f": {s.reason + ': ' if s.reason else ''}{s.message}"[:500] if s.message or s.reason else ""
    except msgspec.DecodeError:
        said = ""
    if status in (401, 403):
        said += " (the planner's service account needs get and patch on deployments/scale: the chart's Role)"
    return said
