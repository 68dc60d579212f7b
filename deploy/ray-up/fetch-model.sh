#!/usr/bin/env bash
# Model provisioning on every node (run by setup_commands): the Serve config's engine.model
# is $MODEL_DIR, a Hugging Face folder that must exist on every node (replicas load it,
# the ingress reads its tokenizer).
#   fetch-model.sh <hub repo id>   download it from the Hugging Face hub (a gated model
#                                  needs a token in ~/vtoken-secrets/hf-token)
#   fetch-model.sh <folder>        use a folder every node already has (a shared file
#                                  system, or baked into the image): linked, not copied
set -euo pipefail
SOURCE=${1:?usage: fetch-model.sh <hub repo id or folder>}
MODEL_DIR=${MODEL_DIR:-$HOME/models/served}
SECRETS=${SECRETS:-$HOME/vtoken-secrets}

mkdir -p "$(dirname "$MODEL_DIR")"
if [ -d "$SOURCE" ]; then
  ln -sfn "$SOURCE" "$MODEL_DIR"
elif [ ! -f "$MODEL_DIR/config.json" ]; then
  if [ -s "$SECRETS/hf-token" ]; then
    HF_TOKEN=$(cat "$SECRETS/hf-token")
    export HF_TOKEN
  fi
  python3 -m pip install -q "huggingface_hub[cli]"
  huggingface-cli download "$SOURCE" --local-dir "$MODEL_DIR" \
    --exclude '*.pth' 'original/*'
fi
test -f "$MODEL_DIR/config.json"
