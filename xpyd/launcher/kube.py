"""A Deployment's replicas through the Kubernetes API's scale subresource, from inside a pod (aiohttp, no client
library); and, where asked, which of its pods goes first when it shrinks.

    GET   {api}/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale  -> a Scale: spec.replicas, and
                                                                                status.selector (its pods' labels)
    PATCH (the same path), Content-Type application/merge-patch+json, {"spec": {"replicas": n}}  -> the new Scale
    GET   {api}/api/v1/namespaces/{namespace}/pods?labelSelector=...           -> its pods: name, IP, deleting?
    PATCH {api}/api/v1/namespaces/{namespace}/pods/{name}, a merge patch of one annotation
          (controller.kubernetes.io/pod-deletion-cost: the ReplicaSet deletes the lowest first)

In a pod (``KubeConfig.in_cluster``): the API server at https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT,
verified with the service account's CA; the service account's token, read again before each call (the kubelet
rotates it). The RBAC it needs: get and patch on deployments/scale of the Deployments it names (the chart's Role
names exactly the prefill and decode Deployments); for deletion costs also list and patch on pods, which RBAC
cannot narrow to one Deployment's pods (their names are made up as they start): the chart grants it only where
``planner.podDeletionCost`` is set. Every call has a timeout; any failure (no answer, a refusal,
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
from urllib.parse import quote

import aiohttp
import msgspec

from xpyd.netaddr import host_port

__all__ = ["DELETION_COST", "KubeConfig", "KubeError", "Pod", "ScaleClient", "SERVICE_ACCOUNT_DIR"]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
MAX_REPLY_BYTES = 4 << 20  # (a pod list of a large Deployment)
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
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


class _ScaleStatus(msgspec.Struct, frozen=True):
    selector: str = ""


class _Scale(msgspec.Struct, frozen=True):
    kind: str
    spec: _ScaleSpec = _ScaleSpec()
    status: _ScaleStatus = _ScaleStatus()


class _PodMeta(msgspec.Struct, frozen=True):
    name: str
    deletionTimestamp: str | None = None  # noqa: N815 (the API's name)


class _PodStatus(msgspec.Struct, frozen=True):
    podIP: str = ""  # noqa: N815
    phase: str = ""


class _PodItem(msgspec.Struct, frozen=True):
    metadata: _PodMeta
    status: _PodStatus = _PodStatus()


class _PodList(msgspec.Struct, frozen=True):
    kind: str
    items: list[_PodItem] = []


class _Status(msgspec.Struct, frozen=True):  # what the API server says when it refuses
    message: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    ip: str  # "" before it has one
    running: bool  # phase Running and not being deleted


class ScaleClient:
    """The replicas of Deployments in one namespace (and their pods' deletion costs); ``open`` before the first
    call, ``close`` after the last."""

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
        return (await self._scale("GET", deployment, None)).spec.replicas

    async def selector(self, deployment: str) -> str:
        """The label selector of the Deployment's pods (status.selector of its scale)."""
        scale = await self._scale("GET", deployment, None)
        if not scale.status.selector:
            raise KubeError(f"the scale of {deployment} names no pod selector")
        return scale.status.selector

    async def scale(self, deployment: str, replicas: int) -> int:
        """Set the Deployment's replicas; what the API server answers they are now."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"replicas must be an int >= 0, got {replicas!r}")
        body = msgspec.json.encode({"spec": {"replicas": replicas}})
        return (await self._scale("PATCH", deployment, body)).spec.replicas

    async def pods(self, selector: str) -> list[Pod]:
        """The namespace's pods with these labels."""
        path = f"/api/v1/namespaces/{self.config.namespace}/pods?labelSelector={quote(selector, safe='')}"
        reply = await self._request("GET", path, None)
        try:
            pods = msgspec.json.decode(reply, type=_PodList)
        except msgspec.DecodeError as e:
            raise KubeError(f"GET {path}: not a pod list ({e})") from None
        if pods.kind != "PodList":
            raise KubeError(f"GET {path}: not a pod list (kind {pods.kind!r})")
        return [Pod(p.metadata.name, p.status.podIP,
                    p.status.phase == "Running" and p.metadata.deletionTimestamp is None) for p in pods.items]

    async def annotate(self, pod: str, key: str, value: str) -> None:
        """Set one annotation of a pod (a merge patch: the others stay)."""
        check_name(pod, "a pod")
        body = msgspec.json.encode({"metadata": {"annotations": {key: value}}})
        await self._request("PATCH", f"/api/v1/namespaces/{self.config.namespace}/pods/{pod}", body)

    async def _scale(self, method: str, deployment: str, body: bytes | None) -> _Scale:
        path = f"/apis/apps/v1/namespaces/{self.config.namespace}/deployments/{deployment}/scale"
        reply = await self._request(method, path, body)
        try:
            scale = msgspec.json.decode(reply, type=_Scale)
        except msgspec.DecodeError as e:
            raise KubeError(f"{method} {path}: not a Scale ({e})") from None
        if scale.kind != "Scale" or scale.spec.replicas < 0:
            raise KubeError(f"{method} {path}: not a Scale (kind {scale.kind!r}, replicas {scale.spec.replicas})")
        return scale

    async def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        if self._session is None:
            raise RuntimeError("ScaleClient.open() first")
        c = self.config
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
            raise KubeError(f"{what}: HTTP {status}{_refusal(status, reply, path)}")
        return reply


def _refusal(status: int, reply: bytes, path: str) -> str:
    try:
        s = msgspec.json.decode(reply, type=_Status)
        said = f": {s.reason + ': ' if s.reason else ''}{s.message}"[:500] if s.message or s.reason else ""
    except msgspec.DecodeError:
        said = ""
    if status in (401, 403):
        said += (" (the planner's service account needs list and patch on pods: the chart's planner.podDeletionCost)"
                 if "/pods" in path else
                 " (the planner's service account needs get and patch on deployments/scale: the chart's Role)")
    return said
