"""The loss curve image for docs/: train and validation loss against tokens seen."""

from __future__ import annotations

import csv
from pathlib import Path


def plot_loss(log_csv: Path, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on the training machine
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(log_csv.open()))
    tokens = [int(r["tokens"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(tokens, [float(r["train_loss"]) for r in rows], label="train (smoothed)")
    ax.plot(tokens, [float(r["val_loss"]) for r in rows], label="validation")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.set_title("llama-chat default model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
