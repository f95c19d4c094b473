"""Exit statuses of ``llama-chat``, in one place (the tests and the docs quote them)."""

import signal

OK = 0  # generation finished, whatever the finish reason
FAILURE = 1  # anything else that went wrong; one line on stderr
USAGE = 2  # bad options or bad input: missing model, unreadable or hostile file, empty or too long prompt
SIGHUP = 128 + signal.SIGHUP  # 129: the terminal hung up (or SIGHUP was sent)
SIGINT = 128 + signal.SIGINT  # 130: stopped by Ctrl+C
SIGQUIT = 128 + signal.SIGQUIT  # 131: Ctrl+\, leave at once
SIGTERM = 128 + signal.SIGTERM  # 143: stopped by SIGTERM
# 141: stdout's reader went away. The status of a writer killed by SIGPIPE, which is what a shell
# pipeline (`set -o pipefail`) expects from `yes | head`-style producers.
OUTPUT_CLOSED = 128 + signal.SIGPIPE


def for_signal(signum: int) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended."""
    return 128 + int(signum)
