"""A pseudo-terminal that is the child's controlling terminal, what it would show, and a model
that always leaves bytes held: what the terminal tests of the one-shot command and the chat share."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import termios
import time
from pathlib import Path

import pexpect
import sentencepiece as spm
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from cli_support import cli_env, llama_chat_command, popen_cli

WAIT_S = 60.0  # how long to wait for something that must happen, on however busy a machine


def save_and_leave(child: pexpect.spawn, path: Path) -> dict:
    """``/save path`` in a chat under pexpect, then Ctrl+D, which must end it with status 0.
    Returns the saved conversation (its messages and settings)."""
    child.sendline("/save " + str(path))
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    return json.loads(path.read_text())


def held_bytes_model(out: Path, sp_model: Path) -> Path:
    """A model whose answer is "é", then the first three bytes of 🐱 and then bos for ever.

    Attention and feed-forward add nothing, so the next token depends only on the last one: a
    chain written into the embeddings (token -> basis vector) and the output rows (basis vector ->
    next token). The decoder then holds three bytes while tokens keep coming, so a Ctrl+C always
    lands while bytes are held.
    """
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    byte = lambda b: sp.piece_to_id(f"<0x{b:02X}>")  # noqa: E731
    chain = [byte(0xC3), byte(0xA9), byte(0xF0), byte(0x9F), byte(0x90), sp.bos_id()]
    model = random_model(tiny_args(sp.vocab_size(), n_layers=1, max_seq_len=16384), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "output.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        emb, out_w = model.tok_embeddings.weight, model.output.weight
        emb.zero_()
        emb[:, 0] = 10.0  # every other token leads to the first of the chain
        for k, token in enumerate(chain):
            emb[token] = 0
            emb[token, min(k + 1, len(chain) - 1)] = 10.0
            out_w[token, k] = 10.0
    return write_meta_checkpoint(model, out, sp_model)


class Pty:
    """A child on a pseudo-terminal that is its controlling terminal; everything shown is kept."""

    def __init__(self, *args: str, columns: int = 120, **env: str) -> None:
        self.primary, secondary = os.openpty()
        fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        attrs = termios.tcgetattr(secondary)
        attrs[3] |= termios.ECHO | termios.ECHOCTL | termios.ISIG | termios.ICANON
        termios.tcsetattr(secondary, termios.TCSANOW, attrs)

        self.proc = popen_cli([*llama_chat_command(), *args], cli_env(TERM="xterm-256color", **env), stdin=secondary,
                              stdout=secondary, stderr=secondary, terminal=True)
        os.close(secondary)
        self.shown = b""

    def read_until(self, condition, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            ready, _, _ = select.select([self.primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.primary, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                self.shown += chunk
        assert condition(), f"timed out; shown so far: {self.shown[-300:]!r}"

    def type(self, data: bytes) -> None:
        os.write(self.primary, data)

    def finish(self) -> int:
        status = None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.primary, 65536)
                except OSError:
                    chunk = b""
                self.shown += chunk
                if chunk:
                    continue
            if self.proc.poll() is not None:
                status = self.proc.returncode
                break
        os.close(self.primary)
        return status if status is not None else self.proc.wait(timeout=10)


SGR = re.compile(rb"\x1b\[[0-9;]*m")


def screen(shown: bytes, columns: int | None = None) -> tuple[list[str], bool]:
    """The lines a terminal shows after ``shown``, and whether the cursor is visible at the end.

    With ``columns``, a line that reaches the right edge wraps when the next character comes
    (xterm's way; one cell per character). Other control characters (a raw ^C echoed by a terminal
    whose ECHOCTL is off) show nothing."""
    rows: list[list[str]] = [[]]
    col, saved, visible = 0, (0, 0), True
    text = SGR.sub(b"", shown).decode("utf-8", errors="replace")
    i = 0
    while i < len(text):
        for seq, action in (("\x1b7", "save"), ("\x1b8", "restore"), ("\x1b[K", "clear"),
                            ("\x1b[?25l", "hide"), ("\x1b[?25h", "show")):
            if text.startswith(seq, i):
                if action == "save":
                    saved = (len(rows) - 1, col)
                elif action == "restore":
                    row, col = saved
                    del rows[row + 1:]
                elif action == "clear":
                    del rows[-1][col:]
                else:
                    visible = action == "show"
                i += len(seq)
                break
        else:
            ch = text[i]
            i += 1
            if ch == "\n":
                rows.append([])
                col = 0
            elif ch == "\r":
                col = 0
            elif ch == "\b":
                col = max(col - 1, 0)
            elif ch < " " or ch == "\x7f":
                pass
            else:
                if columns is not None and col >= columns:
                    rows.append([])
                    col = 0
                row = rows[-1]
                row.extend(" " * (col + 1 - len(row)))
                row[col] = ch
                col += 1
    return ["".join(r).rstrip() for r in rows], visible
