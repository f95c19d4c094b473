"""Write a trained model in Meta's layout, in half precision, as the package ships it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llama_chat.model.transformer import Transformer

CHAT_FORMAT = "llama2"


def export(model: Transformer, tokenizer_model: Path, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    params = model.args.to_params_json()
    params["chat_format"] = CHAT_FORMAT  # how the loader picks the chat template for this model
    (out_dir / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    # float16 halves the package; the tied output projection is the embedding, so it is not stored.
    state = {k: v.detach().to(torch.float16).clone() for k, v in model.state_dict().items()
             if not (model.args.tie_embeddings and k == "output.weight")}
    torch.save(state, out_dir / "consolidated.00.pth")
    shutil.copyfile(tokenizer_model, out_dir / "tokenizer.model")
    return [out_dir / n for n in ("params.json", "consolidated.00.pth", "tokenizer.model")]
