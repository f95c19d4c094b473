"""The training loop: AdamW, linear warmup then cosine decay, gradient clipping, periodic validation.

It trains ``llama_chat.model.transformer.Transformer`` itself (no cache: plain causal attention),
so the shipped weights run on exactly the code that serves them.
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from default_model.data import random_windows
from llama_chat.model.transformer import Transformer


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1400
    batch: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 100
    seed: int = 0


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def batch_loss(model: Transformer, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))


@torch.no_grad()
def validation_loss(model: Transformer, windows: torch.Tensor, chunk: int = 8) -> float:
    model.eval()
    total = sum(batch_loss(model, w).item() * len(w) for w in windows.split(chunk))
    model.train()
    return total / len(windows)


def optimizer_for(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    # Norm gains are not decayed: shrinking them towards zero only fights the normalisation.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    keep = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: Transformer, stream: torch.Tensor, val: torch.Tensor, cfg: TrainConfig, log_path: Path,
          state_path: Path) -> dict:
    """Runs to ``cfg.steps``; resumes from ``state_path`` when it exists (a run that was stopped)."""
    opt = optimizer_for(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, elapsed = 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        model.tie_weights()
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        start, elapsed = state["step"], state["elapsed"]
    new_log = start == 0
    log = log_path.open("w" if new_log else "a", newline="")
    writer = csv.writer(log)
    if new_log:
        writer.writerow(["step", "tokens", "lr", "train_loss", "val_loss", "elapsed_s"])
    model.train()
    t0 = time.perf_counter() - elapsed
    running = None
    for step in range(start, cfg.steps):
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = batch_loss(model, random_windows(stream, cfg.batch, cfg.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            vl = validation_loss(model, val)
            el = time.perf_counter() - t0
            tokens = done * cfg.batch * cfg.seq_len
            writer.writerow([done, tokens, f"{lr:.6g}", f"{running:.4f}", f"{vl:.4f}", f"{el:.1f}"])
            log.flush()
            print(f"step {done}/{cfg.steps} lr {lr:.2e} train {running:.4f} val {vl:.4f} {el:.0f}s", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": done, "elapsed": el}, state_path)
    log.close()
    return {"steps": cfg.steps, "tokens": cfg.steps * cfg.batch * cfg.seq_len,
            "elapsed_s": time.perf_counter() - t0, "val_loss": validation_loss(model, val)}
